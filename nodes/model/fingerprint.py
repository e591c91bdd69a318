"""The model fingerprint both nodes compare before trusting each other's KV (DESIGN.md).

sha256 over config.json, the tokenizer files, and per tensor its name, dtype, shape and a
64 KiB sample of its bytes (start, middle and end thirds). Cached per (path, size, mtime).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.spec import TOKENIZER_FILES

SAMPLE_BYTES = 64 * 1024
_cache: dict[tuple[tuple[str, int, int], ...], str] = {}


def _sample(fd: int, offset: int, nbytes: int) -> bytes:
    if nbytes <= SAMPLE_BYTES:
        return os.pread(fd, nbytes, offset)
    part = SAMPLE_BYTES // 3
    starts = (offset, offset + (nbytes - part) // 2, offset + nbytes - part)
    return b"".join(os.pread(fd, part, s) for s in starts)


def _files(index: ModelIndex) -> list[Path]:
    path = index.spec.path
    named = [path / "config.json"] + [path / n for n in TOKENIZER_FILES if (path / n).exists()]
    return named + list(index.files)


def fingerprint(index: ModelIndex) -> str:
    """Hex sha256 identifying the model's config, tokenizer and weights."""
    files = _files(index)
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key in _cache:
        return _cache[key]
    h = hashlib.sha256()
    for f in files[: len(files) - len(index.files)]:
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes())
    entries = list(index.globals.values()) + [e for layer in index.layers for e in layer.values()]
    fds: dict[Path, int] = {}
    try:
        for e in sorted(entries, key=lambda e: e.name):
            fd = fds.get(e.file)
            if fd is None:
                fd = fds[e.file] = os.open(e.file, os.O_RDONLY)
            h.update(f"{e.name}\0{e.dtype}\0{list(e.shape)}\0".encode())
            h.update(_sample(fd, e.offset, e.nbytes))
    finally:
        for fd in fds.values():
            os.close(fd)
    digest = h.hexdigest()
    _cache[key] = digest
    return digest
