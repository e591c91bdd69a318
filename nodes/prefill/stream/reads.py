"""Reading a load's bytes from the weight files into host memory.

Reads go straight into preallocated memory with `preadv` at the safetensors offsets — no
tensor per layer (glibc keeps freed per-layer buffers) and no lazy mmap of the weights (which
only moves the disk reads into compute time). A whole tensor or a row range is one run of its
file; loads laid out for it (`Load.direct`) are read with O_DIRECT, several reads in flight
(`READ_THREADS`): the disk DMAs into the destination, and the page cache neither costs a copy
nor fills with weights the cyclic access would evict anyway. A column range (a
tensor-parallel rank's share of o_proj or down_proj: one run per line, `Piece.runs`) is the
loader's strided copy out of a read-only mapping of its file that reads no page ahead
(`MADV_RANDOM`), after `POSIX_FADV_WILLNEED` on exactly the pages its runs touch: the other
columns' pages are never read. Whatever did pass through the page cache is dropped after the
read (`POSIX_FADV_DONTNEED`), except for the host tier's loads, which are kept in memory
instead.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
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


def page_ranges(piece: Piece, lines: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """(file offset, bytes) of the whole pages that `piece`'s runs touch (its runs [a, b) with
    `lines`), neighbours merged: one range for a piece that is one run, or whose runs leave
    no page out between them."""
    first, size, stride, count = piece.runs()
    a, b = lines or (0, count)
    if b - a == 1:  # most pieces: no arrays for them
        start = first + a * stride
        lo = start // PAGE * PAGE
        return [(lo, -(-(start + size) // PAGE) * PAGE - lo)]
    starts = first + stride * np.arange(a, b, dtype=np.int64)
    lo, hi = starts // PAGE, -(-(starts + size) // PAGE)  # page numbers, [lo, hi) per run
    cut = np.flatnonzero(lo[1:] > hi[:-1]) + 1  # runs after a page left out
    begins, ends = lo[np.r_[0, cut]], hi[np.r_[cut - 1, len(lo) - 1]]
    return [(int(x) * PAGE, int(y - x) * PAGE) for x, y in zip(begins, ends, strict=True)]


def advise(
    fds: dict[str, int], load: Load, advice: int, skip: Callable[[Piece, int], bool] | None = None
) -> None:
    """posix_fadvise over the pages of each of a load's pieces (not those `skip` names): a
    column range's own pages, never the other columns' between them."""
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        if skip is None or not skip(piece, off):
            for start, n in page_ranges(piece):
                os.posix_fadvise(fds[str(piece.entry.file)], start, n, advice)


def drop_from_page_cache(fds: dict[str, int], load: Load) -> None:
    """Drop what `load` read through the page cache: every page its pieces touch. The kernel
    drops only the pages a range covers whole, and a row range of a cut matrix mostly ends
    inside a page it shares with the next range (which, if still to come, reads that one page
    again)."""
    advise(fds, load, os.POSIX_FADV_DONTNEED)


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
    maps: dict[str, mmap.mmap] | None = None,
) -> int:
    """Read every piece of `load` into `dest` (host memory) at its slot offset. Returns bytes.

    With `direct_fds`, the pieces of a `direct` load go by O_DIRECT when `dest` is aligned,
    cut into `READ_CHUNK` reads; a file that refuses (EINVAL) drops back to the page cache for
    good. A column range is copied out of its file's mapping in `maps` (mapped there when
    missing; without `maps`, mapped for this call only). With `pool`, the reads run in its
    threads, several in flight. The bytes land where `loads.landing` says; `settle` then moves
    them to their offsets (in place), else the caller's copy does (`loads.moves`).
    """
    array = dest.numpy()
    mem = memoryview(array).cast("B")
    direct = direct_fds if load.direct and dest.data_ptr() % DIRECT_ALIGN == 0 else None
    own = maps is None
    maps = {} if maps is None else maps
    reads: list[Callable[[], None]] = []
    try:
        for piece, off in zip(load.pieces, load.offsets, strict=True):
            name = str(piece.entry.file)
            land = landing(piece, off, load.direct)
            span = direct_span(piece, off) if direct and name in direct else None
            if piece.strided:
                if name not in maps:
                    maps[name] = map_file(fds[name])
                reads += _strided_reads(fds[name], maps[name], piece, array, land)
            elif span is not None:
                reads += _direct_reads(
                    fds, direct, name, mem, span, land - span[1] + piece.nbytes, land
                )
            else:
                reads.append(_buffered_read(fds[name], mem, *piece.span(), land))
        if pool is None or len(reads) < 2:
            for read in reads:
                read()
        else:
            futures = [pool.submit(read) for read in reads]
            wait(futures)  # every read finished (or raised) before the load is called in, and
            for done in futures:  # none goes on writing into `dest` after a failed one
                done.result()
    finally:
        if own:
            for mapped in maps.values():
                mapped.close()
    if settle:
        settle_in_place(load, dest)
    return load.weight_bytes


def map_file(fd: int) -> mmap.mmap:
    """A read-only mapping of a whole weight file whose faults read no page ahead: a column
    range's strided copy then reads only its own pages (what `page_ranges` advised)."""
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_RANDOM)
    return mapped


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


def _strided_reads(
    fd: int, mapped: mmap.mmap, piece: Piece, dest: np.ndarray, at: int
) -> list[Callable[[], None]]:
    """The copies that gather a column range's runs out of its file's mapping into `dest`
    (uint8) at `at`, contiguous: its lines cut into reads of about `READ_CHUNK` file bytes,
    each asking the kernel for its pages first (the mapping reads none ahead by itself)."""
    first, size, line, count = piece.runs()
    lead = (first - piece.entry.offset) % line  # bytes in a line before the run
    step = max(1, READ_CHUNK // line)

    def chunk(a: int, b: int) -> Callable[[], None]:
        def read() -> None:
            for start, n in page_ranges(piece, (a, b)):
                os.posix_fadvise(fd, start, n, os.POSIX_FADV_WILLNEED)
            src = np.frombuffer(mapped, np.uint8, (b - a) * line, first - lead + a * line)
            try:  # [lines, line bytes][:, run] → [lines, run bytes]
                dst = dest[at + a * size : at + b * size].reshape(b - a, size)
                np.copyto(dst, src.reshape(b - a, line)[:, lead : lead + size])
            finally:
                del src  # the mapping closes only once no array holds it

        return read

    return [chunk(a, min(a + step, count)) for a in range(0, count, step)]


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
        self.maps: dict[str, mmap.mmap] = {}  # per file, once a column range is read from it
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tandem-read")

    def read(
        self, load: Load, dest: torch.Tensor, tier: HostTier | None, settle: bool = True
    ) -> int:
        """Read `load` into host memory `dest` (`settle`: see `read_load`); drop what went
        through the page cache unless `dest` is the host tier's (then the tier is where the
        bytes are kept)."""
        n = read_load(self.fds, load, dest, self.direct, self.pool, settle, self.maps)
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
        for mapped in self.maps.values():
            mapped.close()
        for fd in [*self.fds.values(), *self.direct.values()]:
            os.close(fd)
        self.fds, self.direct, self.maps = {}, {}, {}
