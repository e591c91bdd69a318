"""Models by id (issue 51, 1): `--model org/name` found offline in the Hugging Face cache (the
hub's real layout: blobs, snapshots of links, refs/main), in LM Studio's models and in models
folders; `tandem models` lists them, `tandem pull` says when it is offline, a miss is one line
naming where it looked, nodes serve by id and a model mismatch names both sides' revisions."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from tandem.app.cli.main import main
from tandem.nodes.model.locate import find_model, locate
from tandem.nodes.model.spec import load_spec

from tests.conftest import MakeTiny
from tests.nodeproc import NodeProc, start_node, stop_all, wait_healthy, wait_trusted

REPO, REV = "org/tiny", "0123456789abcdef0123456789abcdef01234567"
HW = ["--device", "cpu", "--pcie-gbps", "16", "--disk-gbps", "4", "--tflops", "1",
      "--net-gbps", "10", "--mac-tok-s", "100", "--host-budget", "0"]  # fmt: skip
ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TANDEM_MODELS")


def hub_copy(model: Path, hub: Path, repo_id: str, rev: str) -> Path:
    """`model` as huggingface_hub caches it: blobs by sha256, a snapshot of relative links to
    them, refs/main naming the snapshot; its snapshot directory."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for f in sorted(model.iterdir()):
        data = f.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snapshot / f.name)
    return snapshot


@pytest.fixture
def caches(tiny_model: MakeTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny model in a Hugging Face cache (`HF_HOME`, set after huggingface_hub was
    imported: tandem reads it when it looks) and in LM Studio's folder (`HOME`)."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub  # noqa: F401  imported first: its constants are the old ones

    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    model = tiny_model()
    hub_copy(model, tmp_path / "hf" / "hub", REPO, REV)
    shutil.copytree(model, tmp_path / "home" / ".lmstudio" / "models" / "pub" / "tiny")
    (tmp_path / "home" / ".lmstudio" / "models" / "pub" / "other").mkdir()  # no model in it
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_locate_finds_the_hub_cache_lm_studio_and_models_dirs(
    caches: Path, tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = caches / "hf" / "hub" / "models--org--tiny" / "snapshots" / REV
    found = find_model(REPO)
    assert (found.path, found.where, found.id, found.revision) == (snapshot, "hf-cache", REPO, REV)
    assert locate(f"{REPO}@{REV}") == snapshot
    assert find_model(snapshot).revision == REV  # a snapshot given by path keeps its revision
    assert load_spec(snapshot).name == REPO  # not the commit hash it is filed under
    lms = find_model("pub/tiny")
    assert (lms.where, lms.path) == ("lmstudio", caches / "home/.lmstudio/models/pub/tiny")
    shelf, env_shelf = caches / "shelf", caches / "env-shelf"
    shutil.copytree(tiny_model(), shelf / "acme" / "small")
    shutil.copytree(tiny_model(), env_shelf / "smaller")
    assert locate("acme/small", [shelf]) == shelf / "acme" / "small"
    monkeypatch.setenv("TANDEM_MODELS", os.pathsep.join([str(caches / "nowhere"), str(env_shelf)]))
    assert locate("someone/smaller") == env_shelf / "smaller"  # <dir>/name
    assert locate("smaller") == env_shelf / "smaller"


def test_a_missing_model_is_one_line_naming_where_it_looked(
    caches: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shelf = caches / "shelf"
    argv = ["plan", "--model", "org/nope", "--models-dir", str(shelf), "--budget", "1GiB", *HW]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tandem plan: model org/nope not found"), err
    for place in (caches / "hf/hub/models--org--nope", caches / "home/.lmstudio/models/org/nope",
                  shelf / "org/nope", shelf / "nope"):  # fmt: skip
        assert str(place) in err, (place, err)
    assert "tandem pull org/nope" in err
    assert main(["plan", "--model", str(caches / "no-such-dir"), "--budget", "1GiB", *HW]) == 2
    assert "no such model directory" in capsys.readouterr().err


def test_plan_takes_an_id(caches: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", REPO, "--budget", "64MiB", "--json", *HW]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["name"] == REPO
    assert report["model"]["path"].endswith(f"models--org--tiny/snapshots/{REV}")


def test_pull_offline_says_so_in_one_line(
    caches: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["pull", "org/elsewhere"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "offline" in err and "org/elsewhere" in err, err
    assert not (caches / "hf" / "hub" / "models--org--elsewhere").exists()


def test_models_lists_each_place_with_family_and_support(
    caches: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shelf = caches / "shelf"
    (shelf / "encoder").mkdir(parents=True)  # a model tandem does not serve
    (shelf / "encoder" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["models", "--json", "--models-dir", str(shelf)]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {REPO, "pub/tiny", "encoder"}, rows
    hub, lms, bert = rows[REPO], rows["pub/tiny"], rows["encoder"]
    assert (hub["where"], hub["revision"], hub["family"]) == ("hf-cache", REV, "llama")
    assert hub["supported"] and lms["supported"] and hub["why"] == ""
    assert hub["size_bytes"] == lms["size_bytes"] > 0  # the blobs, not the links
    assert hub["quantization"] is None and hub["dtype"] == "float32"
    assert (bert["family"], bert["supported"]) == ("bert", False)
    assert bert["why"] and "\n" not in bert["why"]
    assert main(["models", "--models-dir", str(shelf)]) == 0
    table = capsys.readouterr().out
    assert REPO in table and "no: " in table


def _log_line(node: NodeProc, text: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in node.output().splitlines() if text in line]
        if lines:
            return lines[0]
        time.sleep(0.2)
    raise TimeoutError(f"no {text!r} in its log:\n{node.output()}")


def test_nodes_serve_by_id_and_a_mismatch_names_both_revisions(
    caches: Path, tiny_model: MakeTiny
) -> None:
    """A prefill node by LM Studio's id, a decode node (mlx-lm, through the hub's links) by
    the hub's; a third node on another model refuses the decode node, naming both."""
    env = {k: os.environ[k] for k in ("HF_HOME", "HOME")}
    prefill = start_node(caches, Path("pub/tiny"), "prefill", "--budget", "64MiB", env=env,
                         wait=False)  # fmt: skip
    nodes = [prefill]
    try:
        decode = start_node(caches, Path(REPO), "decode", "--peer", prefill.url, env=env,
                            wait=False)  # fmt: skip
        nodes.append(decode)
        other = start_node(caches, tiny_model(seed=1), "prefill", "--peer", decode.url,
                           env=env, wait=False)  # fmt: skip
        nodes.append(other)
        health = wait_healthy(decode)
        assert (health.model_name, health.model_revision) == (REPO, REV)
        assert wait_healthy(prefill).model_revision == ""
        wait_trusted(decode)  # LM Studio's copy and the hub's: one fingerprint
        line = _log_line(other, "serves another model")
        assert f"{REPO}@{REV[:12]}" in line, line
        assert f"here local directory {tiny_model(seed=1).name}" in line, line
    finally:
        stop_all(nodes)
