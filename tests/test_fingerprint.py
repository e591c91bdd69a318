"""The model fingerprint: equal for equal files, different for any weight or config change."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from tandem.nodes.model import fingerprint, load_index
from tandem.nodes.model.index import TensorEntry

MakeTiny = Callable[..., Path]  # the `tiny_model` fixture (tests/conftest.py)


def _copy(model: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(model, tmp_path / name))


def _flip(entry: TensorEntry, at: int) -> None:
    """Invert one byte of a tensor's data, `at` bytes into it."""
    with open(entry.file, "r+b") as f:
        f.seek(entry.offset + at)
        byte = f.read(1)
        f.seek(entry.offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_hex_sha256(tiny_model: MakeTiny) -> None:
    fp = fingerprint(load_index(tiny_model()))
    assert len(fp) == 64
    int(fp, 16)


def test_equal_for_a_copied_directory(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = tiny_model(arch="qwen2", shards=2)
    copy = _copy(model, tmp_path)
    assert fingerprint(load_index(copy)) == fingerprint(load_index(model))


def test_differs_between_models(tiny_model: MakeTiny) -> None:
    fps = {
        fingerprint(load_index(tiny_model(arch="llama"))),
        fingerprint(load_index(tiny_model(arch="llama", seed=1))),
        fingerprint(load_index(tiny_model(arch="mistral"))),
        fingerprint(load_index(tiny_model(arch="llama", dtype="bfloat16"))),
    }
    assert len(fps) == 4


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("model.layers.2.self_attn.q_proj.weight", "start"),  # 16 KiB: sampled whole
        ("model.layers.2.self_attn.q_proj.weight", "end"),
        ("model.embed_tokens.weight", "start"),  # 128 KiB: sampled in three parts
        ("model.embed_tokens.weight", "middle"),
        ("model.embed_tokens.weight", "end"),
        ("lm_head.weight", "end"),
    ],
)
def test_differs_after_one_weight_changes(
    tiny_model: MakeTiny, tmp_path: Path, name: str, where: str
) -> None:
    model = tiny_model(shards=2)
    before = fingerprint(load_index(model))
    copy = _copy(model, tmp_path)
    index = load_index(copy)
    entry = index.globals.get(name) or index.layers[2][name.split(".", 3)[3]]
    at = {"start": 0, "middle": entry.nbytes // 2, "end": entry.nbytes - 1}[where]
    _flip(entry, at)
    assert fingerprint(load_index(copy)) != before


def test_differs_after_a_config_change(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = tiny_model()
    copy = _copy(model, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    assert fingerprint(load_index(copy)) != fingerprint(load_index(model))


def test_differs_after_a_tokenizer_change(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = tiny_model()
    copy = _copy(model, tmp_path)
    tokenizer_config = copy / "tokenizer_config.json"
    tokenizer_config.write_text(tokenizer_config.read_text().replace("im_start", "im_begin"))
    assert fingerprint(load_index(copy)) != fingerprint(load_index(model))


def test_cached_per_path_size_and_mtime(
    tiny_model: MakeTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = _copy(tiny_model(arch="qwen3"), tmp_path)
    calls = 0
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        nonlocal calls
        calls += 1
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    index = load_index(copy)
    first = fingerprint(index)
    reads = calls
    assert reads > 0
    assert fingerprint(index) == first
    assert fingerprint(load_index(copy)) == first
    assert calls == reads  # answered from the cache

    # a rewritten file (new mtime) is read again
    entry = index.layers[0]["self_attn.q_proj.weight"]
    _flip(entry, 0)
    stat = entry.file.stat()
    os.utime(entry.file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert fingerprint(load_index(copy)) != first
    assert calls > reads
