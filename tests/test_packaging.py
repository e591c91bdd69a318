"""The service files and the Dockerfile run commands tandem's real parser accepts, and
`tandem pair` creates, stores and checks the cluster token."""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tandem.app.cli.main import build_parser

from tests.nodeproc import start_node

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"


def _parse(argv: list[str]):
    assert Path(argv[0]).name == "tandem", argv[0]
    return build_parser().parse_args(argv[1:])


def test_systemd_unit_runs_a_prefill_node() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(PACKAGING / "tandem-prefill.service")
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["User"] != "root"
    a = _parse(shlex.split(service["ExecStart"]))
    assert (a.command, a.role, a.port) == ("node", "prefill", 8470)
    assert a.token_file == Path("/etc/tandem/token")  # a non-loopback host needs the token
    assert a.host == "0.0.0.0"
    assert "WantedBy" in unit["Install"]


def test_launchd_plist_runs_a_decode_node() -> None:
    with open(PACKAGING / "com.tandem.decode.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "com.tandem.decode"
    a = _parse(plist["ProgramArguments"])
    assert (a.command, a.role, a.remote_prefill) == ("node", "decode", "auto")
    assert plist["KeepAlive"] and plist["RunAtLoad"]


def test_dockerfile_entrypoint_runs_a_prefill_node() -> None:
    text = (PACKAGING / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:", text, re.M)
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    a = _parse(entry)
    assert (a.command, a.role, a.model) == ("node", "prefill", "/model")  # an id or a path
    assert a.token_file is not None
    assert "'.[prefill]'" in text  # only the prefill extra: no mlx in a CUDA image


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    """The wheel `pip install .` would install, built once from a copy of the checkout (an
    in-tree build would leave build/ and egg-info behind in the working tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("app", "nodes", "tandem"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*cmd, "--no-index", "-w", str(tmp / "out"), str(src)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (built,) = (tmp / "out").glob("tandem_llm-*.whl")
    with zipfile.ZipFile(built) as z:
        yield z


def test_wheel_installs_only_the_tandem_name(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {t for t in tops if re.fullmatch(r"tandem_llm-[^/]+\.dist-info", t)}
    assert len(dist_info) == 1, tops
    assert tops - dist_info == {"tandem"}, tops  # no `app` or `nodes` beside it
    assert "tandem/__init__.py" not in wheel.namelist()  # a namespace: no folder of its own


def test_wheel_holds_the_packages_and_their_data(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "tandem/app/tui/tandem.tcss" in names
    assert "tandem/app/__main__.py" in names  # python -m tandem.app
    assert "tandem/__main__.py" in names  # python -m tandem (torchrun -m tandem node ...)
    assert "tandem/nodes/contract/frames.py" in names
    assert not any("__pycache__" in n or n.startswith("tests/") for n in names)


def test_every_packaging_file_says_how_to_install_it() -> None:
    for f in PACKAGING.iterdir():
        head = f.read_text()[:1200].lower()
        assert "install" in head or "build" in head, f.name


def _tandem(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.app", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("TANDEM_TOKEN", None)
    return env


def test_pair_creates_a_private_token_and_prints_the_command(home: dict[str, str]) -> None:
    first = _tandem(home, "pair")
    assert first.returncode == 0
    path = Path(home["XDG_CONFIG_HOME"]) / "tandem" / "token"
    token = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert f"tandem pair --set {token}" in first.stdout
    again = _tandem(home, "pair")  # the token is made once
    assert path.read_text().strip() == token and "Using" in again.stdout


def test_pair_set_stores_the_token(home: dict[str, str], tmp_path: Path) -> None:
    token = "x" * 43
    done = _tandem(home, "pair", "--set", token)
    assert done.returncode == 0
    path = Path(home["XDG_CONFIG_HOME"]) / "tandem" / "token"
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _tandem(home, "pair", "--set", "short").returncode == 2


def test_pair_check_and_nodes_read_the_stored_token(
    home: dict[str, str], tiny_model, tmp_path: Path
) -> None:
    model = tiny_model(arch="llama", layers=2)
    assert _tandem(home, "pair").returncode == 0
    # the node reads the stored token with no --token-file (same config dir)
    node = start_node(tmp_path, model, "prefill", env={"XDG_CONFIG_HOME": home["XDG_CONFIG_HOME"]})
    try:
        ok = _tandem(home, "pair", "--check", node.url)
        assert ok.returncode == 0 and "trusted" in ok.stdout
        other = {**home, "XDG_CONFIG_HOME": str(tmp_path / "elsewhere")}
        assert _tandem(other, "pair", "--set", "y" * 43).returncode == 0
        bad = _tandem(other, "pair", "--check", node.url)
        assert bad.returncode == 1 and "does NOT hold" in bad.stdout
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as e:  # /v1/* needs the stored token
            urllib.request.urlopen(node.url + "/v1/cluster", timeout=5)
        assert e.value.code == 401
    finally:
        node.stop()
    gone = _tandem(home, "pair", "--check", node.url)
    assert gone.returncode == 1 and "cannot reach" in gone.stdout
