"""Movers put a load's bytes into slot memory: disk → host → device.

Both movers read straight into preallocated memory with `preadv` at the safetensors offsets —
no tensor per layer (glibc keeps freed per-layer buffers) and no lazy mmap (which only moves
the disk reads into compute time).

- `CpuMover`: the slot *is* host memory; the loader thread reads into it, then waits out the
  emulated host→device link (`--link-gbps`). Loads laid out for it (`Load.direct`) are read
  with O_DIRECT: the disk DMAs into the slot, and the page cache neither costs a copy on the
  cores that compute nor fills with weights the cyclic access would evict anyway.
- `CudaMover`: the loader thread reads into a pinned staging buffer per slot, then enqueues
  `slot.copy_(staging, non_blocking=True)` on a dedicated copy stream and records an event;
  compute waits on that event, and the copy stream waits on the compute-done event of the
  slot's previous occupant. No per-layer `empty_cache`.

fastsafetensors and runai-model-streamer were considered for the CUDA reader: both allocate
their own device tensors per file or per tensor, which does not fit a fixed slot pool with
row/column slices. Plain `preadv` into pinned staging keeps the pool the only device memory.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from nodes.prefill.plan import DIRECT_ALIGN, Load, direct_span

log = logging.getLogger(__name__)


@dataclass
class FillTimes:
    disk_s: float = 0.0  # reading file bytes into host memory
    h2d_s: float = 0.0  # host → device copy (or the emulated link)
    nbytes: int = 0
    disk_bytes: int = 0  # of nbytes, how many came from disk (the rest from the host tier)


class HostTier:
    """Loads kept in host memory across requests (`--host-budget`): VRAM first, system RAM
    second, disk last. A fixed set chosen up front — the access is cyclic, so never LRU.
    Everything else is read from disk each pass and dropped from the page cache right after
    (`POSIX_FADV_DONTNEED`), so the weights do not crowd out the tier or thrash the cache."""

    def __init__(self, loads: list[Load], budget: int, pin: bool = False) -> None:
        self.budget = budget
        self.members: set[int] = set()
        used = 0
        for load in loads:  # the first streamed loads: a fixed set, in cycle order
            if used + load.nbytes > budget:
                break
            self.members.add(load.seq)
            used += load.nbytes
        self.bytes = used
        self._pin = pin
        self._buffers: dict[int, torch.Tensor] = {}
        self._holding: set[int] = set()  # loads whose buffer holds a complete read

    def buffer(self, load: Load) -> tuple[torch.Tensor | None, bool]:
        """(host buffer for a member load or None, whether it already holds the load)."""
        if load.seq not in self.members:
            return None, False
        buf = self._buffers.get(load.seq)
        if buf is None:
            buf = aligned_empty(load.nbytes, pin=self._pin)
            self._buffers[load.seq] = buf
        return buf, load.seq in self._holding

    def hold(self, load: Load) -> None:
        """The load's buffer now holds it: called only once its read has succeeded, so a read
        that failed halfway is read again next time, never used as weights."""
        if load.seq in self.members:
            self._holding.add(load.seq)


def advise(fds: dict[str, int], load: Load, advice: int) -> None:
    """posix_fadvise over the file ranges of a load's pieces."""
    for piece in load.pieces:
        fd = fds[str(piece.entry.file)]
        os.posix_fadvise(fd, piece.entry.offset, piece.entry.nbytes, advice)


def drop_from_page_cache(fds: dict[str, int], load: Load) -> None:
    advise(fds, load, os.POSIX_FADV_DONTNEED)


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
) -> int:
    """Read every piece of `load` into `dest` (host memory) at its slot offset. Returns bytes.

    With `direct_fds`, the pieces of a `direct` load go by O_DIRECT when `dest` is aligned;
    a file that refuses (EINVAL) drops back to the page cache for good.
    """
    mem = memoryview(dest.numpy()).cast("B")
    direct = direct_fds if load.direct and dest.data_ptr() % DIRECT_ALIGN == 0 else None
    total = 0
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        name = str(piece.entry.file)
        span = direct_span(piece, off) if direct and name in direct else None
        if span is not None and direct is not None:
            file_offset, at, n = span
            try:
                _pread_direct(direct[name], mem[at : at + n], file_offset, off - at + piece.nbytes)
                total += piece.nbytes
                continue
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("%s: O_DIRECT read refused, reading through the page cache", name)
                os.close(direct.pop(name))
        pos = off
        for file_offset, n in piece.segments():
            _pread_exact(fds[name], mem[pos : pos + n], file_offset)
            pos += n
        total += piece.nbytes
    return total


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

    def close(self) -> None: ...


class Throttle:
    """Emulates a slower host→device link: a copy of n bytes takes at least n / rate."""

    def __init__(self, link_gbps: float | None) -> None:
        self.set(link_gbps)

    def set(self, link_gbps: float | None) -> None:
        self.rate = link_gbps * 1e9 / 8 if link_gbps else None  # bytes/s

    def wait(self, nbytes: int, started: float) -> None:
        if self.rate:
            left = nbytes / self.rate - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)


class CpuMover:
    """Slots in host memory; the loader thread reads straight into them."""

    def __init__(
        self,
        files: list[str],
        link_gbps: float | None = None,
        device: torch.device | None = None,
        tier: HostTier | None = None,
    ) -> None:
        self.device = device or torch.device("cpu")
        self._fds = {f: os.open(f, os.O_RDONLY) for f in files}
        self._direct = open_direct(files) if self.device.type == "cpu" else {}
        self.throttle = Throttle(link_gbps)
        self.tier = tier

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
            disk = read_load(self._fds, load, target, self._direct)
            if self.tier is not None and kept is None:
                drop_from_page_cache(self._fds, load)
            elif self.tier is not None and target is kept:
                self.tier.hold(load)
        t1 = time.perf_counter()
        if host is not None:
            region[: load.nbytes].copy_(host)
        # the emulated link caps the whole fill: reading into host memory is part of the copy
        self.throttle.wait(load.weight_bytes, t0)
        return FillTimes(t1 - t0, time.perf_counter() - t1, load.weight_bytes, disk)

    def prefetch(self, load: Load) -> None:
        if load.direct and self._direct:
            return  # O_DIRECT reads skip the page cache: read-ahead there would be wasted
        if self.tier is None or load.seq not in self.tier.members:
            advise(self._fds, load, os.POSIX_FADV_WILLNEED)

    def wait_ready(self, slot: int) -> None:
        return None

    def mark_done(self, slot: int) -> None:
        return None

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._direct.values()]:
            os.close(fd)
        self._fds, self._direct = {}, {}


class CudaMover:
    """Pinned staging per slot, a dedicated copy stream, events between copy and compute."""

    def __init__(
        self,
        files: list[str],
        device: torch.device,
        link_gbps: float | None = None,
        tier: HostTier | None = None,
    ) -> None:
        self.device = device
        self._fds = {f: os.open(f, os.O_RDONLY) for f in files}
        self.throttle = Throttle(link_gbps)
        self.tier = tier
        self._stream = torch.cuda.Stream(device=device)
        self._staging: dict[int, torch.Tensor] = {}
        self._copied: dict[int, torch.cuda.Event] = {}  # per slot id: its last h2d copy
        self._staged: dict[int, torch.cuda.Event] = {}  # per staging buffer: its last copy
        self._computed: dict[int, torch.cuda.Event] = {}

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def fill(self, slot: int, region: torch.Tensor, load: Load) -> FillTimes:
        t0 = time.perf_counter()
        host, cached = self.tier.buffer(load) if self.tier else (None, False)
        disk = 0
        key = max(slot, -1)  # ring slots have their own staging; resident loads share one
        if host is not None:
            staging = host  # pinned: the tier copies straight from its own buffer
            if not cached:
                disk = read_load(self._fds, load, staging)
                assert self.tier is not None
                self.tier.hold(load)
        else:
            staging = self._staging.get(key)
            if staging is None or staging.numel() < load.nbytes:
                staging = torch.empty(load.nbytes, dtype=torch.uint8, pin_memory=True)
                self._staging[key] = staging
            previous = self._staged.get(key)
            if previous is not None:
                previous.synchronize()  # the staging buffer is free once its last copy finished
            disk = read_load(self._fds, load, staging)
            if self.tier is not None:
                drop_from_page_cache(self._fds, load)
        t1 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            done = self._computed.get(slot)
            if done is not None:
                self._stream.wait_event(done)  # previous occupant's kernels have finished
            region[: load.nbytes].copy_(staging[: load.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._copied[slot] = event
        if host is None:
            self._staged[key] = event
        event.synchronize()  # h2d time is measured; the compute stream still waits on the event
        self.throttle.wait(load.weight_bytes, t1)
        return FillTimes(t1 - t0, time.perf_counter() - t1, load.weight_bytes, disk)

    def prefetch(self, load: Load) -> None:
        if self.tier is None or load.seq not in self.tier.members:
            advise(self._fds, load, os.POSIX_FADV_WILLNEED)

    def wait_ready(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._copied[slot])

    def mark_done(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._computed[slot] = event

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self._staging.clear()


def make_mover(
    files: list[str],
    device: torch.device,
    link_gbps: float | None,
    tier: HostTier | None = None,
) -> Mover:
    if device.type == "cuda":
        return CudaMover(files, device, link_gbps, tier)
    return CpuMover(files, link_gbps, device, tier)
