"""The disk's cold read rate for the cost model, read as the loader reads weights
(`stream/reads.py`): O_DIRECT where the file system allows it, `READ_CHUNK` reads,
`READ_THREADS` in flight; on a CPU beside compute, at the loader's niceness."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tandem.nodes.prefill.planning.loads import DIRECT_ALIGN
from tandem.nodes.prefill.stream.reads import READ_CHUNK, READ_THREADS
from tandem.nodes.prefill.stream.streamer import lower_this_thread

DISK_PROBE_BYTES = 192 << 20


def _write_probe(fd: int, nbytes: int) -> None:
    """Fill an open file with `nbytes` of incompressible bytes, on disk, out of the cache."""
    block = os.urandom(1 << 20)
    for off in range(0, nbytes, len(block)):
        os.write(fd, block[: nbytes - off])
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _read_probe(path: Path, nbytes: int, nice: int = 0) -> float:
    """Seconds to read the file once as movers.py reads weights: O_DIRECT where the file
    system allows it, `READ_CHUNK` reads, `READ_THREADS` in flight, at niceness `nice`."""
    buf = torch.zeros(nbytes + DIRECT_ALIGN, dtype=torch.uint8)  # touched, as slots are
    skip = -buf.data_ptr() % DIRECT_ALIGN  # O_DIRECT: an aligned address
    mem = memoryview(buf[skip : skip + nbytes].numpy()).cast("B")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        os.preadv(fd, [mem[:DIRECT_ALIGN]], 0)
    except OSError:  # O_DIRECT refused here: through the page cache (dropped after writing)
        fd = os.open(path, os.O_RDONLY)

    def read(lo: int) -> None:
        view, off = mem[lo : min(nbytes, lo + READ_CHUNK)], lo
        while len(view):
            n = os.preadv(fd, [view], off)
            if n <= 0:
                raise OSError(f"short read at offset {off}")
            view, off = view[n:], off + n

    try:
        if nice:
            lower_this_thread(nice)  # the pool's threads start from here: they inherit it
        with ThreadPoolExecutor(READ_THREADS) as pool:
            t0 = time.perf_counter()
            list(pool.map(read, range(0, nbytes, READ_CHUNK)))
            return time.perf_counter() - t0
    finally:
        os.close(fd)


def _beside(busy: Callable[[], object], fn: Callable[[], float]) -> float:
    """`fn()` on a thread of its own while `busy()` runs in a loop on this one."""
    out: list[float] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # raised again on the calling thread
            errors.append(e)

    thread = threading.Thread(target=target, name="tandem-disk-probe")
    thread.start()
    while thread.is_alive():
        busy()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def measure_disk_Bps(
    directory: Path | None = None, nbytes: int = DISK_PROBE_BYTES,
    busy: Callable[[], object] | None = None, nice: int = 0,
) -> float:  # fmt: skip
    """Cold read bytes/s of a file written in `directory` (the weights' file system; the
    temp dir where that is not writable), read back uncached; the file is removed. With
    `busy`, read at niceness `nice` while `busy()` keeps the cores computing: what a CPU
    loader gets beside compute."""
    for where in (directory, None):
        try:
            fd, name = tempfile.mkstemp(prefix=".tandem-disk-probe-", dir=where)
        except OSError:
            continue
        path = Path(name)
        try:
            try:
                _write_probe(fd, nbytes)
            finally:
                os.close(fd)
            if busy is None:
                return nbytes / _read_probe(path, nbytes)
            return nbytes / _beside(busy, lambda p=path: _read_probe(p, nbytes, nice))
        finally:
            path.unlink(missing_ok=True)
    raise OSError("no writable directory for the disk probe")
