"""Reading a load's bytes from the weight files into host memory.

Reads go straight into preallocated memory with `preadv` at the safetensors offsets — no
tensor per layer (glibc keeps freed per-layer buffers) and no lazy mmap of the weights (which
only moves the disk reads into compute time). Every piece is one run of its file (the plan
cuts matrices by rows only). Loads laid out for it (`Load.direct`) are read with O_DIRECT,
several reads in flight (`READ_THREADS`): the disk DMAs into the destination, and the page
cache neither costs a copy nor fills with weights the cyclic access would evict anyway.
Whatever did pass through the page cache is dropped after the read (`POSIX_FADV_DONTNEED`),
except for the host tier's loads, which are kept in memory instead.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from tandem.nodes.prefill.planning.loads import (
    DIRECT_ALIGN,
    Load,
    Piece,
    direct_span,
    landing,
    moves,
)
from tandem.nodes.prefill.stream.host import HostTier

log = logging.getLogger(__name__)
PAGE = os.sysconf("SC_PAGE_SIZE")

READ_THREADS = 4  # reads in flight per load: NVMe wants a queue, one preadv at a time is not one
READ_CHUNK = 8 << 20  # bytes: O_DIRECT spans are cut into reads of at most this


def advise(
    fds: dict[str, int], load: Load, advice: int, skip: Callable[[Piece, int], bool] | None = None
) -> None:
    """posix_fadvise over the file range of each of a load's pieces (not those `skip` names)."""
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        if skip is None or not skip(piece, off):
            start, n = piece.span()
            os.posix_fadvise(fds[str(piece.entry.file)], start, n, advice)


def drop_from_page_cache(fds: dict[str, int], load: Load) -> None:
    """Drop what `load` read through the page cache: every page its pieces touch. The kernel
    drops only the pages a range covers whole, and a row range of a cut matrix mostly ends
    inside a page it shares with the next range (which, if still to come, reads that one page
    again)."""
    for piece in load.pieces:
        start, n = piece.span()
        lo = start // PAGE * PAGE
        hi = -(-(start + n) // PAGE) * PAGE
        os.posix_fadvise(fds[str(piece.entry.file)], lo, hi - lo, os.POSIX_FADV_DONTNEED)


def open_direct(files: list[str]) -> dict[str, int]:
    """O_DIRECT descriptors for the files that allow it (not tmpfs, not every FUSE)."""
    fds: dict[str, int] = {}
    if not hasattr(os, "O_DIRECT"):  # macOS: F_NOCACHE would be the analogue
        return fds
    for f in files:
        try:
            fds[f] = os.open(f, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            log.info("%s: no O_DIRECT here, reading through the page cache", f)
    return fds


def read_load(
    fds: dict[str, int],
    load: Load,
    dest: torch.Tensor,
    direct_fds: dict[str, int] | None = None,
    pool: ThreadPoolExecutor | None = None,
    settle: bool = True,
) -> int:
    """Read every piece of `load` into `dest` (host memory) at its slot offset. Returns bytes.

    With `direct_fds`, the pieces of a `direct` load go by O_DIRECT when `dest` is aligned,
    cut into `READ_CHUNK` reads; a file that refuses (EINVAL) drops back to the page cache for
    good. With `pool`, the reads run in its threads, several in flight. The bytes land where
    `loads.landing` says; `settle` then moves them to their offsets (in place), else the
    caller's copy does (`loads.moves`).
    """
    mem = memoryview(dest.numpy()).cast("B")
    direct = direct_fds if load.direct and dest.data_ptr() % DIRECT_ALIGN == 0 else None
    reads: list[Callable[[], None]] = []
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        name = str(piece.entry.file)
        land = landing(piece, off, load.direct)
        span = direct_span(piece, off) if direct and name in direct else None
        if span is not None:
            reads += _direct_reads(
                fds, direct, name, mem, span, land - span[1] + piece.nbytes, land
            )
        else:
            reads.append(_buffered_read(fds[name], mem, *piece.span(), land))
    if pool is None or len(reads) < 2:
        for read in reads:
            read()
    else:
        for done in [pool.submit(read) for read in reads]:
            done.result()  # every read finished (or raised) before the load is called in
    if settle:
        settle_in_place(load, dest)
    return load.weight_bytes


def settle_in_place(load: Load, dest: torch.Tensor) -> None:
    """Move a load's pieces from where they landed down to their `ALIGN`-aligned offsets, in
    host memory (each by less than `ALIGN` bytes; memmove allows the overlap)."""
    base = dest.data_ptr()
    for dst, src, n in moves(load):
        if dst != src:
            ctypes.memmove(base + dst, base + src, n)


def _buffered_read(
    fd: int, mem: memoryview, file_offset: int, n: int, at: int
) -> Callable[[], None]:
    def read() -> None:
        _pread_exact(fd, mem[at : at + n], file_offset)

    return read


def _direct_reads(
    fds: dict[str, int],
    direct: dict[str, int] | None,
    name: str,
    mem: memoryview,
    span: tuple[int, int, int],
    need: int,
    off: int,
) -> list[Callable[[], None]]:
    """The aligned O_DIRECT reads of one piece's span, `READ_CHUNK` each. Span-relative
    bytes [off - at, need) are the piece's; the last read may run past the end of the file."""
    assert direct is not None
    file_offset, at, n = span
    head = off - at

    def chunk(lo: int, hi: int) -> Callable[[], None]:
        def read() -> None:
            fd = direct.get(name)
            if fd is not None:
                try:
                    _pread_direct(fd, mem[at + lo : at + hi], file_offset + lo, min(hi, need) - lo)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    log.info("%s: O_DIRECT read refused, reading through the page cache", name)
                    # kept open (other reads may hold it) under a name no piece uses
                    if (refused := direct.pop(name, None)) is not None:
                        direct[f"refused:{name}"] = refused
            lo_, hi_ = max(lo, head), min(hi, need)  # this read's share of the piece
            if hi_ > lo_:
                _pread_exact(fds[name], mem[at + lo_ : at + hi_], file_offset + lo_)

        return read

    return [chunk(lo, min(lo + READ_CHUNK, n)) for lo in range(0, need, READ_CHUNK)]


def _pread_direct(fd: int, buf: memoryview, offset: int, need: int) -> None:
    """Aligned reads until `need` bytes are in (the span may run past the end of the file)."""
    got = 0
    while got < need:
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise OSError(f"short read at offset {offset + got}")
        got += n


def _pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise OSError(f"short read at offset {offset}")
        buf, offset = buf[n:], offset + n


class Reader:
    """A mover's file descriptors (buffered and O_DIRECT) and its pool of read threads."""

    def __init__(self, files: list[str], direct: bool) -> None:
        self.fds = {f: os.open(f, os.O_RDONLY) for f in files}
        for fd in self.fds.values():  # no readahead of its own: `prefetch` asks for exactly
            # what comes next, while the kernel's would read on through a tensor's rows that
            # an earlier load took and dropped, and they would stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.direct = open_direct(files) if direct else {}
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tandem-read")

    def read(
        self, load: Load, dest: torch.Tensor, tier: HostTier | None, settle: bool = True
    ) -> int:
        """Read `load` into host memory `dest` (`settle`: see `read_load`); drop what went
        through the page cache unless `dest` is the host tier's (then the tier is where the
        bytes are kept)."""
        n = read_load(self.fds, load, dest, self.direct, self.pool, settle)
        if tier is None or load.seq not in tier.members:
            drop_from_page_cache(self.fds, load)
        return n

    def prefetch(self, load: Load, tier: HostTier | None) -> None:
        """Read-ahead for the pieces that go through the page cache. O_DIRECT spans skip it
        (a hint there would be wasted); the rest — small norms, every piece where O_DIRECT
        is refused — would otherwise wait on a synchronous disk read each (the descriptors
        have no kernel readahead, `Reader`)."""
        if tier is not None and load.seq in tier.members:
            return
        direct = self.direct if load.direct else {}

        def by_direct(piece: Piece, off: int) -> bool:
            return str(piece.entry.file) in direct and direct_span(piece, off) is not None

        advise(self.fds, load, os.POSIX_FADV_WILLNEED, by_direct)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in [*self.fds.values(), *self.direct.values()]:
            os.close(fd)
        self.fds, self.direct = {}, {}
