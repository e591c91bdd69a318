"""`--verify-weights`: every tensor read once, NaN/Inf refused by name, clean files cached by
(path, size, mtime); through `tandem node` and `tandem pair --check` too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tandem.app.cli.main import main
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import TensorEntry, load_index
from tandem.nodes.model.verify import Verified, verify_weights

from tests.conftest import MakeTiny

ROOT = Path(__file__).resolve().parents[1]
BAD = r"tensor \S+ holds \d+ NaN/Inf values: the file is corrupt or truncated"


def _copy(tiny_model: MakeTiny, tmp_path: Path, **kwargs: object) -> Path:
    """A private copy of a session model: the tests below write into it."""
    return Path(shutil.copytree(tiny_model(**kwargs), tmp_path / "model"))


def _ff(f: Path, offset: int, n: int) -> None:
    """Overwrite `n` bytes at `offset` with 0xff (NaN in every float dtype), in place."""
    with open(f, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff" * n)


def _ff_tail(model: Path, n: int = 4000) -> None:
    f = model / "model.safetensors"
    _ff(f, f.stat().st_size - n, n)


def _verify(model: Path, cache: Path | None = None) -> Verified:
    return verify_weights(load_index(model), cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_clean_verifies_and_a_0xff_tail_names_its_tensor(
    tiny_model: MakeTiny, tmp_path: Path, dtype: str
) -> None:
    model = _copy(tiny_model, tmp_path, dtype=dtype, tie_embeddings=True)
    index = load_index(model)
    v = verify_weights(index)
    assert v.tensors == sum(len(layer) for layer in index.layers) + len(index.globals)
    assert v.read_bytes == v.nbytes == index.total_bytes
    _ff_tail(model)
    with pytest.raises(ModelError, match=rf"model\.safetensors: {BAD}") as err:
        _verify(model)
    assert "model.layers.3." in str(err.value)  # tied embeddings: the last layer ends the file


def test_each_tensor_hashed(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """A finite change (one byte of a norm weight) changes the digest, and only that."""
    model = _copy(tiny_model, tmp_path)
    before = _verify(model)
    norm = load_index(model).globals["model.norm.weight"]
    _ff(norm.file, norm.offset, 1)  # low byte of an F32: still finite
    after = _verify(model)
    assert after.digest != before.digest and after.tensors == before.tensors


def test_cache_hit_then_invalidated_by_mtime(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model, tmp_path, shards=2)
    cache = tmp_path / "cache" / "verified.json"
    first = _verify(model, cache)
    assert first.read_bytes == first.nbytes and cache.exists()
    second = _verify(model, cache)
    assert second.read_bytes == 0 and second.digest == first.digest
    # corrupt one shard with its mtime kept: the cache still answers (size and mtime are the key)
    shard = sorted(model.glob("model-*.safetensors"))[-1]
    stat = shard.stat()
    _ff(shard, stat.st_size - 4000, 4000)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _verify(model, cache).read_bytes == 0
    os.utime(shard)  # touched: that shard alone is read again
    with pytest.raises(ModelError, match=rf"{shard.name}: {BAD}"):
        _verify(model, cache)
    with pytest.raises(ModelError, match=BAD):  # a failure is not cached
        _verify(model, cache)


def test_unreadable_cache_is_ignored(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model, tmp_path)
    cache = tmp_path / "verified.json"
    cache.write_text("{not json")
    assert _verify(model, cache).read_bytes > 0
    assert _verify(model, cache).read_bytes == 0  # rewritten whole


def _entry(model: Path, name: str) -> TensorEntry:
    index = load_index(model)
    return {**index.globals, **{f"model.layers.0.{k}": e for k, e in index.layers[0].items()}}[name]


def test_quantized_checks_scales_not_packed_words(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """0xff words are a valid packed weight (hashed only); 0xff scales are NaN."""
    model = _copy(tiny_model, tmp_path, intermediate=128, quantize=4, group_size=64)
    words = _entry(model, "model.layers.0.mlp.up_proj.weight")
    assert words.dtype == "U32"
    _ff(words.file, words.offset, words.nbytes)
    _verify(model)
    scales = _entry(model, "model.layers.0.mlp.up_proj.scales")
    _ff(scales.file, scales.offset + scales.itemsize, scales.itemsize)
    with pytest.raises(ModelError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.scales holds 1 "):
        _verify(model)


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg-cache"),
            "XDG_CONFIG_HOME": str(tmp_path / "xdg-config")}  # fmt: skip


def test_node_refuses_to_start_on_corrupt_weights(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """The real command, as the issue found it: both roles would start and answer ""."""
    model = _copy(tiny_model, tmp_path)
    _ff_tail(model)
    cmd = [sys.executable, "-m", "tandem.app", "node", "--model", str(model), "--no-mdns",
           "--port", "0", "--verify-weights"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, timeout=60)
    assert done.returncode != 0
    assert b"tandem node: " in done.stderr and b"NaN/Inf values" in done.stderr
    assert b"tensor lm_head.weight" in done.stderr


def test_pair_check_verifies_the_local_model(
    tiny_model: MakeTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    model = _copy(tiny_model, tmp_path)
    assert main(["pair", "--verify-weights", str(model)]) == 2
    assert "--verify-weights goes with --check" in capsys.readouterr().err
    assert main(["pair"]) == 0  # a token, so the check gets as far as the weights
    _ff_tail(model)
    # the weights fail before the check dials anyone (nothing listens on port 9)
    assert main(["pair", "--check", "http://127.0.0.1:9", "--verify-weights", str(model)]) == 2
    assert "tensor lm_head.weight holds" in capsys.readouterr().err


def test_bench_verify_reports_the_three_runs(
    tiny_model: MakeTiny, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model()
    assert main(["bench", "verify", str(model), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bytes"] == load_index(model).total_bytes
    assert r["cold_Bps"] > 0 and r["warm_Bps"] > 0 and r["cached_s"] >= 0
