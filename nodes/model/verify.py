"""Read every tensor byte once: a sha256 per tensor, and no NaN or Inf in any float tensor.

The fingerprint samples the files, so weights corrupted past its samples load and serve
(decode then answers empty text). This reads them all: each file's tensors in offset order,
a few at a time on a thread pool (pread, hashlib and numpy release the GIL), in chunks of
`CHUNK_BYTES`. MLX-quantized weights are U32 packed words (any pattern is a valid value):
hashed only; their float scales and biases are checked.

A file that verified clean is cached in a JSON file keyed by (path, size, mtime_ns), so an
unchanged model verifies instantly; a rewritten or touched file is read again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, TensorEntry

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024 * 1024  # per read; a multiple of every itemsize
PROGRESS_EVERY_S = 3.0
MAX_WORKERS = 8  # threads reading, hashing and checking tensors at once (one core each)
CACHE_VERSION = 1
# float dtypes, as their bit patterns: (unsigned view, mask of sign-less bits, smallest
# non-finite pattern: exponent all ones). F32 and F64 use np.isfinite, which is SIMD there.
_HALF_BITS: dict[str, tuple[type[np.unsignedinteger], int, int]] = {
    "BF16": (np.uint16, 0x7FFF, 0x7F80),
    "F16": (np.uint16, 0x7FFF, 0x7C00),
}
_WIDE = {"F32": np.float32, "F64": np.float64}


@dataclass(frozen=True)
class Verified:
    """What a verification covered: every tensor of the model, `read_bytes` of it read now
    (0 when every file came from the cache)."""

    tensors: int
    nbytes: int  # all tensors' bytes
    read_bytes: int  # bytes read and checked by this run
    seconds: float
    digest: str  # sha256 over each tensor's name and sha256, in name order

    @property
    def rate(self) -> float:
        """Bytes per second of what was read (0 when nothing was)."""
        return self.read_bytes / self.seconds if self.read_bytes and self.seconds else 0.0


def verify_weights(index: ModelIndex, cache_file: Path | None = None) -> Verified:
    """Read and check every tensor of `index` whose file is not in `cache_file` as it is now.

    Raises ModelError naming the file and the tensor: non-finite values, or a short file.
    """
    t0 = time.perf_counter()
    entries = list(index.globals.values()) + [e for layer in index.layers for e in layer.values()]
    by_file: dict[Path, list[TensorEntry]] = {f: [] for f in index.files}
    for e in entries:
        by_file[e.file].append(e)
    cache = _load_cache(cache_file)
    digests: dict[str, str] = {}
    todo: dict[Path, list[TensorEntry]] = {}
    for f, es in by_file.items():
        hit = _cached(cache, f, es)
        if hit is None:
            todo[f] = sorted(es, key=lambda e: e.offset)
        else:
            digests.update(hit)
    read = sum(e.nbytes for es in todo.values() for e in es)
    progress = _Progress(read)
    for f, es in todo.items():
        stat = f.stat()  # before reading: a write while reading leaves a key that won't match
        found = _verify_file(f, es, progress)
        digests.update(found)
        cache[str(f.resolve())] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                   "tensors": found}  # fmt: skip
    if todo and cache_file is not None:
        _save_cache(cache_file, cache)
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\0".encode())
    done = Verified(len(entries), sum(e.nbytes for e in entries), read,
                    time.perf_counter() - t0, h.hexdigest())  # fmt: skip
    _log_done(done)
    return done


def _log_done(v: Verified) -> None:
    if not v.read_bytes:
        log.info("weights verified (cached): %d tensors, %.2f GB, sha256 %s",
                 v.tensors, v.nbytes / 1e9, v.digest[:16])  # fmt: skip
        return
    log.info("weights verified: %d tensors, %.2f GB read in %.1f s (%.2f GB/s), sha256 %s",
             v.tensors, v.read_bytes / 1e9, v.seconds, v.rate / 1e9, v.digest[:16])  # fmt: skip


class _Progress:
    """Bytes done across the pool's threads, logged at INFO every few seconds."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if now - self.last < PROGRESS_EVERY_S:
                return
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            log.info("verifying weights: %.2f / %.2f GB (%.2f GB/s)",
                     self.done / 1e9, self.total / 1e9, rate / 1e9)  # fmt: skip


def _verify_file(f: Path, entries: list[TensorEntry], progress: _Progress) -> dict[str, str]:
    """{tensor: sha256} of one file's tensors (in offset order); raises at the first bad one."""
    workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1))
    local = threading.local()

    with _opened(f) as fd:

        def one(e: TensorEntry) -> tuple[str, int]:
            if not hasattr(local, "buf"):
                local.buf = bytearray(CHUNK_BYTES)
                local.scratch = np.empty(CHUNK_BYTES // 2, dtype=np.uint16)
            return _check_tensor(fd, e, local.buf, local.scratch, progress.add)

        with ThreadPoolExecutor(workers, thread_name_prefix="verify") as pool:
            results = pool.map(one, entries)  # in order: each tensor's answer as it comes
            found: dict[str, str] = {}
            try:
                for e, (digest, bad) in zip(entries, results, strict=True):
                    if bad:
                        raise ModelError(
                            f"{f}: tensor {e.name} holds {bad} NaN/Inf values: "
                            "the file is corrupt or truncated"
                        )
                    found[e.name] = digest
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    return found


@contextmanager
def _opened(f: Path) -> Iterator[int]:
    try:
        fd = os.open(f, os.O_RDONLY)
    except OSError as e:
        raise ModelError(f"{f}: cannot read ({e.strerror})") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _check_tensor(
    fd: int, e: TensorEntry, buf: bytearray, scratch: np.ndarray, done: Callable[[int], None]
) -> tuple[str, int]:
    """(sha256 hex, count of non-finite values) of one tensor, read in chunks into `buf`."""
    h = hashlib.sha256()
    bad = 0
    view = memoryview(buf)
    pos = 0
    while pos < e.nbytes:
        want = min(CHUNK_BYTES, e.nbytes - pos)
        try:
            got = os.preadv(fd, [view[:want]], e.offset + pos)
        except OSError as err:
            raise ModelError(f"{e.file}: tensor {e.name}: read failed ({err.strerror})") from None
        if got < want:
            raise ModelError(f"{e.file}: tensor {e.name} runs past the end of the file")
        chunk = view[:want]
        h.update(chunk)
        bad += _non_finite(chunk, e.dtype, scratch)
        pos += want
        done(want)
    return h.hexdigest(), bad


def _non_finite(chunk: memoryview, dtype: str, scratch: np.ndarray) -> int:
    """How many NaN/Inf values `chunk` holds as `dtype` (0 for non-float dtypes). A quick
    whole-chunk test first; counted only when it fails."""
    wide = _WIDE.get(dtype)
    if wide is not None:
        a = np.frombuffer(chunk, dtype=wide)
        return 0 if np.isfinite(a).all() else int(a.size - np.count_nonzero(np.isfinite(a)))
    half = _HALF_BITS.get(dtype)
    if half is None:
        return 0  # integers, packed quantized words: every pattern is a value
    kind, mask, first_bad = half
    u = np.frombuffer(chunk, dtype=kind)
    s = scratch[: u.size]
    np.bitwise_and(u, mask, out=s)  # the sign dropped: the largest pattern decides
    if s.max(initial=0) < first_bad:
        return 0
    return int(np.count_nonzero(s >= first_bad))


def _cached(cache: dict[str, dict], f: Path, entries: list[TensorEntry]) -> dict[str, str] | None:
    """The file's {tensor: sha256} if the cache holds it at its current size and mtime."""
    try:
        stat = f.stat()
    except OSError as e:
        raise ModelError(f"{f}: cannot read ({e.strerror})") from None
    hit = cache.get(str(f.resolve()))
    if not hit or (hit.get("size"), hit.get("mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
        return None
    tensors = hit.get("tensors")
    if not isinstance(tensors, dict) or set(tensors) != {e.name for e in entries}:
        return None
    return {str(k): str(v) for k, v in tensors.items()}


def _load_cache(path: Path | None) -> dict[str, dict]:
    """{resolved file path: {"size", "mtime_ns", "tensors"}}; empty when absent or unreadable."""
    if path is None:
        return {}
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the weights cache %s: %s", path, e)
        return {}
    if not isinstance(body, dict) or body.get("version") != CACHE_VERSION:
        return {}
    files = body.get("files")
    if not isinstance(files, dict):
        return {}
    return {str(k): v for k, v in files.items() if isinstance(v, dict)}


def _save_cache(path: Path, files: dict[str, dict]) -> None:
    """Write atomically (a second node verifying at once replaces it whole); a cache that
    cannot be written only costs the next run a full read."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": files}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write the weights cache %s: %s", path, e)
        tmp.unlink(missing_ok=True)
