"""Movers put a load's bytes into slot memory: disk → host → device.

Both movers read straight into preallocated memory with `preadv` at the safetensors offsets —
no tensor per layer (glibc keeps freed per-layer buffers) and no lazy mmap of the weights
(which only moves the disk reads into compute time). Every piece is one run of its file (the
plan cuts matrices by rows only). Loads laid out for it (`Load.direct`) are read with
O_DIRECT, several reads in flight (`READ_THREADS`): the disk DMAs into the destination, and
the page cache neither costs a copy nor fills with weights the cyclic access would evict
anyway. Whatever did pass through the page cache is dropped after the read
(`POSIX_FADV_DONTNEED`), except for the host tier's loads, which are kept in memory instead.

- `CpuMover`: the slot *is* host memory; the loader thread reads into it. `--link-gbps`
  emulates a slower link: the whole fill (disk included) takes at least bytes / rate.
- `CudaMover`: the loader thread reads into one of `N_STAGING` pinned staging buffers, then
  enqueues `slot.copy_(staging, non_blocking=True)` on a dedicated copy stream and records an
  event; compute waits on that event, the copy waits on the compute-done event of the slot's
  previous occupant, and a staging buffer is refilled only once its last copy is done — so
  the disk read of load j+1 overlaps the PCIe copy of load j. Copy times come from CUDA events
  read at the end of the request (`finish`), never from a wait per load.

Host memory that a copy reads from (staging, host tier) is one `HostArena` per use, taken up
front at its exact size and pinned once (`cudaHostRegister`): torch's pinned allocator rounds
every request up to a power of two, allocates on first use (an implicit device sync, and a
failure mid-request) and keeps what it took.

fastsafetensors and runai-model-streamer were considered for the CUDA reader: both allocate
their own device tensors per file or per tensor, which does not fit a fixed slot pool with
row slices. Plain `preadv` into pinned staging keeps the pool the only device memory.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from tandem.nodes.prefill.loads import DIRECT_ALIGN, Load, Piece, direct_span
from tandem.nodes.prefill.plan import Plan

log = logging.getLogger(__name__)
PAGE = os.sysconf("SC_PAGE_SIZE")

READ_THREADS = 4  # reads in flight per load: NVMe wants a queue, one preadv at a time is not one
READ_CHUNK = 8 << 20  # bytes: O_DIRECT spans are cut into reads of at most this
N_STAGING = 2  # CUDA: pinned buffers, so the disk fills one while the other crosses PCIe


class PinError(RuntimeError):
    """Host memory could not be pinned (at start-up: never halfway through a request)."""


@dataclass
class FillTimes:
    disk_s: float = 0.0  # reading file bytes into host memory
    h2d_s: float = 0.0  # host → device copy (CUDA: 0 here, measured by events in `finish`)
    nbytes: int = 0
    disk_bytes: int = 0  # of nbytes, how many came from disk (the rest from the host tier)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class HostArena:
    """One block of host memory, taken up front and handed out in `DIRECT_ALIGN`-aligned
    pieces (O_DIRECT reads land in them). With `pin`, registered with CUDA once, at exactly
    its size: `pinned_bytes` is what is really pinned."""

    def __init__(self, sizes: list[int], pin: bool = False) -> None:
        total = sum(_round_up(n, DIRECT_ALIGN) for n in sizes)
        self._mem = aligned_empty(total)
        self._cursor = 0
        self.nbytes = total
        self.pinned_bytes = 0
        self._unpin: weakref.finalize | None = None
        if pin and total:
            code = int(torch.cuda.cudart().cudaHostRegister(self._mem.data_ptr(), total, 0))
            if code != 0:
                raise PinError(
                    f"cannot pin {total / 2**30:.2f} GiB of host memory for staging and the host"
                    f" tier (cudaError {code}); lower --host-budget or --budget"
                )
            self.pinned_bytes = total
            # unregistered before the memory goes back, even for an arena never closed: freed
            # memory left registered makes the next registration at that address fail
            self._unpin = weakref.finalize(self, _unregister, self._mem)

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the arena (uint8, aligned)."""
        start = self._cursor
        end = start + _round_up(nbytes, DIRECT_ALIGN)
        if end > self.nbytes:
            raise ValueError(f"host arena of {self.nbytes} B cannot hand out {nbytes} B more")
        self._cursor = end
        return self._mem[start : start + nbytes]

    def close(self) -> None:
        """Unpin (once); the caller has made sure no copy into or out of it is in flight."""
        if self._unpin is not None:
            self._unpin()
        self.pinned_bytes = 0


def _unregister(mem: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(mem.data_ptr()))
    if code != 0:
        log.warning("cudaHostUnregister of %d B failed (cudaError %d)", mem.numel(), code)


class HostTier:
    """Loads kept in host memory across requests (`--host-budget`): VRAM first, system RAM
    second, disk last. A fixed set chosen up front — the access is cyclic, so never LRU.
    Everything else is read from disk each pass and dropped from the page cache right after
    (`POSIX_FADV_DONTNEED`), so the weights do not crowd out the tier or thrash the cache."""

    def __init__(self, loads: list[Load], budget: int, pin: bool = False) -> None:
        self.budget = budget
        self.members: set[int] = set()
        chosen: list[Load] = []
        used = 0
        for load in loads:  # the first streamed loads: a fixed set, in cycle order
            if used + load.nbytes > budget:
                break
            self.members.add(load.seq)
            chosen.append(load)
            used += load.nbytes
        self.bytes = used
        self._arena = HostArena([ld.nbytes for ld in chosen], pin)  # all of it now, pinned once
        self._buffers = {ld.seq: self._arena.take(ld.nbytes) for ld in chosen}
        self._holding: set[int] = set()  # loads whose buffer holds a complete read

    @property
    def pinned_bytes(self) -> int:
        return self._arena.pinned_bytes

    def buffer(self, load: Load) -> tuple[torch.Tensor | None, bool]:
        """(host buffer for a member load or None, whether it already holds the load)."""
        buf = self._buffers.get(load.seq)
        return buf, buf is not None and load.seq in self._holding

    def hold(self, load: Load) -> None:
        """The load's buffer now holds it: called only once its read has succeeded, so a read
        that failed halfway is read again next time, never used as weights."""
        if load.seq in self.members:
            self._holding.add(load.seq)

    def close(self) -> None:
        self._buffers.clear()
        self._holding.clear()
        self._arena.close()


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


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """uint8 host memory whose first byte is `DIRECT_ALIGN`-aligned (O_DIRECT's rule)."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


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
) -> int:
    """Read every piece of `load` into `dest` (host memory) at its slot offset. Returns bytes.

    With `direct_fds`, the pieces of a `direct` load go by O_DIRECT when `dest` is aligned,
    cut into `READ_CHUNK` reads; a file that refuses (EINVAL) drops back to the page cache for
    good. With `pool`, the reads run in its threads, several in flight.
    """
    mem = memoryview(dest.numpy()).cast("B")
    direct = direct_fds if load.direct and dest.data_ptr() % DIRECT_ALIGN == 0 else None
    reads: list[Callable[[], None]] = []
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        name = str(piece.entry.file)
        span = direct_span(piece, off) if direct and name in direct else None
        if span is not None:
            reads += _direct_reads(fds, direct, name, mem, span, off - span[1] + piece.nbytes, off)
        else:
            reads.append(_buffered_read(fds[name], mem, *piece.span(), off))
    if pool is None or len(reads) < 2:
        for read in reads:
            read()
    else:
        for done in [pool.submit(read) for read in reads]:
            done.result()  # every read finished (or raised) before the load is called in
    return load.weight_bytes


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


class Mover(Protocol):
    device: torch.device
    throttle: Throttle
    tier: HostTier | None
    loader_nice: int  # the loader thread's niceness: on a CPU it yields to compute

    def prepare(self, plan: Plan) -> None:
        """Once, before the first fill: take the host memory the plan's loads need."""
        ...

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Weight memory on the device (uint8)."""
        ...

    def fill(self, slot: int, region: torch.Tensor, load: Load) -> FillTimes:
        """On the loader thread: put `load` into `region`.

        `slot` is the ring index, or negative for a resident load.
        """
        ...

    def prefetch(self, load: Load) -> None:
        """On the loader thread: ask the disk for a later load's bytes now (no wait)."""
        ...

    def wait_ready(self, slot: int) -> None:
        """On the compute thread, before computing on `slot`."""
        ...

    def mark_done(self, slot: int) -> None:
        """On the compute thread, after the last kernel that reads `slot` was issued."""
        ...

    def finish(self) -> float:
        """After a request: host→device seconds not yet counted in its `FillTimes`."""
        ...

    @property
    def pinned_bytes(self) -> int: ...

    def close(self) -> None: ...


class Throttle:
    """Emulates a slower link from storage to the device: a fill of n bytes takes at least
    n / rate, counted from the start of the fill (the disk read included) on every device."""

    def __init__(self, link_gbps: float | None) -> None:
        self.set(link_gbps)

    def set(self, link_gbps: float | None) -> None:
        self.rate = link_gbps * 1e9 / 8 if link_gbps else None  # bytes/s

    def wait(self, nbytes: int, started: float) -> None:
        if self.rate:
            left = nbytes / self.rate - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)


class _Reader:
    """A mover's file descriptors (buffered and O_DIRECT) and its pool of read threads."""

    def __init__(self, files: list[str], direct: bool) -> None:
        self.fds = {f: os.open(f, os.O_RDONLY) for f in files}
        for fd in self.fds.values():  # no readahead of its own: `prefetch` asks for exactly
            # what comes next, while the kernel's would read on through a tensor's rows that
            # an earlier load took and dropped, and they would stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.direct = open_direct(files) if direct else {}
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tandem-read")

    @property
    def direct_files(self) -> set[str]:
        """The files still read with O_DIRECT (not refused)."""
        return {f for f in self.direct if not f.startswith("refused:")}

    def read(self, load: Load, dest: torch.Tensor, tier: HostTier | None) -> int:
        """Read `load` into host memory `dest`; drop what went through the page cache unless
        `dest` is the host tier's (then the tier is where the bytes are kept)."""
        n = read_load(self.fds, load, dest, self.direct, self.pool)
        if tier is None or load.seq not in tier.members:
            drop_from_page_cache(self.fds, load)
        return n

    def prefetch(self, load: Load, tier: HostTier | None) -> None:
        """Read-ahead for the pieces that go through the page cache. O_DIRECT spans skip it
        (a hint there would be wasted); the rest — small norms, every piece where O_DIRECT
        is refused — would otherwise wait on a synchronous disk read each (the descriptors
        have no kernel readahead, `_Reader`)."""
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


class CpuMover:
    """Slots in host memory; the loader thread reads straight into them."""

    loader_nice = 10  # below compute, so its reads wait for the gaps (see streamer)

    def __init__(
        self,
        files: list[str],
        link_gbps: float | None = None,
        device: torch.device | None = None,
        tier: HostTier | None = None,
    ) -> None:
        self.device = device or torch.device("cpu")
        self._reader = _Reader(files, direct=self.device.type == "cpu")
        self.throttle = Throttle(link_gbps)
        self.tier = tier

    @property
    def pinned_bytes(self) -> int:
        return 0

    def prepare(self, plan: Plan) -> None:
        return None

    def alloc(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return aligned_empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def fill(self, slot: int, region: torch.Tensor, load: Load) -> FillTimes:
        t0 = time.perf_counter()
        host, cached = self.tier.buffer(load) if self.tier else (None, False)
        kept = host  # the tier's buffer for this load, if it is a member
        disk = 0
        if not cached:
            target = host if host is not None else region
            if target.device.type != "cpu":  # e.g. mps: read into host memory first
                target = host = aligned_empty(load.nbytes)
            disk = self._reader.read(load, target, self.tier)
            if self.tier is not None and target is kept:
                self.tier.hold(load)
        t1 = time.perf_counter()
        if host is not None:
            region[: load.nbytes].copy_(host)
        self.throttle.wait(load.weight_bytes, t0)
        return FillTimes(t1 - t0, time.perf_counter() - t1, load.weight_bytes, disk)

    def prefetch(self, load: Load) -> None:
        self._reader.prefetch(load, self.tier)

    def wait_ready(self, slot: int) -> None:
        return None

    def mark_done(self, slot: int) -> None:
        return None

    def finish(self) -> float:
        return 0.0

    def close(self) -> None:
        self._reader.close()
        if self.tier is not None:
            self.tier.close()


class CudaMover:
    """Pinned staging, a dedicated copy stream, events between copy and compute."""

    loader_nice = 0  # the loader is the critical path on a GPU: never lowered

    def __init__(
        self,
        files: list[str],
        device: torch.device,
        link_gbps: float | None = None,
        tier: HostTier | None = None,
    ) -> None:
        self.device = device
        self._reader = _Reader(files, direct=True)
        self.throttle = Throttle(link_gbps)
        self.tier = tier
        self._stream = torch.cuda.Stream(device=device)
        self._arena: HostArena | None = None
        self._staging: list[torch.Tensor] = []
        self._staged: list[torch.cuda.Event | None] = []  # per staging buffer: its last copy
        self._fills = 0
        self._copied: dict[int, torch.cuda.Event] = {}  # per slot id: its last h2d copy
        self._computed: dict[int, torch.cuda.Event] = {}
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def pinned_bytes(self) -> int:
        tier = self.tier.pinned_bytes if self.tier is not None else 0
        return tier + (self._arena.pinned_bytes if self._arena is not None else 0)

    def prepare(self, plan: Plan) -> None:
        """Pin `N_STAGING` buffers of the largest streamed load, once (resident loads that do
        not fit them are staged through pageable memory: they load once, at warm-up)."""
        streamed = [ld.nbytes for ld in plan.loads if not ld.resident]
        size = max(streamed, default=0)
        self._arena = HostArena([size] * N_STAGING if size else [], pin=True)
        self._staging = [self._arena.take(size) for _ in range(N_STAGING)] if size else []
        self._staged = [None] * len(self._staging)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def fill(self, slot: int, region: torch.Tensor, load: Load) -> FillTimes:
        t0 = time.perf_counter()
        host, cached = self.tier.buffer(load) if self.tier else (None, False)
        disk, k, pinned, waited = 0, None, True, 0.0
        if host is not None:
            staging = host  # pinned: the tier copies straight from its own buffer
            if not cached:
                disk = self._reader.read(load, staging, self.tier)
                assert self.tier is not None
                self.tier.hold(load)
        elif self._staging and load.nbytes <= self._staging[0].numel():
            k = self._fills % len(self._staging)
            self._fills += 1
            staging = self._staging[k]
            previous = self._staged[k]
            if previous is not None:
                w0 = time.perf_counter()
                previous.synchronize()  # free once its last copy is done (a blocking wait)
                waited = time.perf_counter() - w0  # the copy's time, not the disk's
            disk = self._reader.read(load, staging, self.tier)
        else:  # a resident load bigger than the staging: once, through pageable memory
            staging, pinned = aligned_empty(load.nbytes), False
            disk = self._reader.read(load, staging, self.tier)
        t1 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            done = self._computed.get(slot)
            if done is not None:
                self._stream.wait_event(done)  # previous occupant's kernels have finished
            start = torch.cuda.Event(enable_timing=True, blocking=True)
            end = torch.cuda.Event(enable_timing=True, blocking=True)
            start.record(self._stream)
            region[: load.nbytes].copy_(staging[: load.nbytes], non_blocking=pinned)
            end.record(self._stream)
        self._copied[slot] = end
        self._timed.append((start, end))
        if k is not None:
            self._staged[k] = end
        self.throttle.wait(load.weight_bytes, t0)
        return FillTimes(t1 - t0 - waited, 0.0, load.weight_bytes, disk)

    def prefetch(self, load: Load) -> None:
        self._reader.prefetch(load, self.tier)

    def wait_ready(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._copied[slot])

    def mark_done(self, slot: int) -> None:
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        self._computed[slot] = event

    def finish(self) -> float:
        """Seconds the copies of the request took on the copy stream, from their events."""
        timed, self._timed = self._timed, []
        if not timed:
            return 0.0
        timed[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in timed) / 1000  # ms → s

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._reader.close()
        self._staging.clear()
        if self._arena is not None:
            self._arena.close()
        if self.tier is not None:
            self.tier.close()


def make_mover(
    files: list[str],
    device: torch.device,
    link_gbps: float | None,
    tier: HostTier | None = None,
) -> Mover:
    if device.type == "cuda":
        return CudaMover(files, device, link_gbps, tier)
    return CpuMover(files, link_gbps, device, tier)
