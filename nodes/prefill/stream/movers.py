"""Movers put a load's bytes into slot memory: disk → host → device.

Both read with `reads.Reader` (O_DIRECT straight into preallocated memory, several reads in
flight, the page cache dropped behind them) and keep the host tier's loads in system RAM
(`host.HostTier`).

- `CpuMover`: the slot *is* host memory; the loader thread reads into it. `--link-gbps`
  emulates a slower link: the whole fill (disk included) takes at least bytes / rate.
- `CudaMover`: the loader thread reads into one of `N_STAGING` pinned staging buffers, then
  enqueues `slot.copy_(staging, non_blocking=True)` on a dedicated copy stream and records an
  event (a copy per run of pieces that landed alike, `loads.moves`: the copy itself moves an
  O_DIRECT piece down to its aligned offset, where a CPU slot is settled in place); compute
  waits on that event, the copy waits on the compute-done event of the slot's previous
  occupant, and a staging buffer is refilled only once its last copy is done — so
  the disk read of load j+1 overlaps the PCIe copy of load j. Copy times come from CUDA events
  read at the end of the request (`finish`), never from a wait per load.

fastsafetensors and runai-model-streamer were considered for the CUDA reader: both allocate
their own device tensors per file or per tensor, which does not fit a fixed slot pool with
row slices. Plain `preadv` into pinned staging keeps the pool the only device memory.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from tandem.nodes.contract.units import gbps_to_Bps
from tandem.nodes.prefill.planning.loads import Load, moves
from tandem.nodes.prefill.planning.plan import Plan
from tandem.nodes.prefill.stream.host import HostArena, HostTier, aligned_empty
from tandem.nodes.prefill.stream.reads import Reader

N_STAGING = 2  # CUDA: pinned buffers, so the disk fills one while the other crosses PCIe
E = TypeVar("E")  # a copy's completion event (CUDA's, or a thread's)


@dataclass
class FillTimes:
    disk_s: float = 0.0  # reading file bytes into host memory
    h2d_s: float = 0.0  # host → device copy (CUDA: 0 here, measured by events in `finish`)
    nbytes: int = 0
    disk_bytes: int = 0  # of nbytes, how many came from disk (the rest from the host tier)


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
        self.rate = gbps_to_Bps(link_gbps) if link_gbps else None  # bytes/s

    def wait(self, nbytes: int, started: float) -> None:
        if self.rate:
            left = nbytes / self.rate - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)


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
        self._reader = Reader(files, direct=self.device.type == "cpu")
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
            tier = self.tier if target is kept else None  # the read goes into the tier
            disk = self._reader.read(tier.missing(load) if tier else load, target, self.tier)
            if tier is not None:
                tier.hold(load)
        t1 = time.perf_counter()
        if host is not None:  # one memmove: torch's copy_ would spread over threads and
            # compete with compute for the cores (the RAM tier then lost to the disk: 1.2x)
            if min(region.numel(), host.numel()) < load.nbytes:  # never past either buffer
                raise ValueError(f"load {load.seq}: {load.nbytes} bytes do not fit its buffers")
            ctypes.memmove(region.data_ptr(), host.data_ptr(), load.nbytes)
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


class CopyEvents(Generic[E]):
    """Per slot id, the event of its last copy, which compute waits on before it reads the
    slot. A slot whose loads so far moved nothing (a routed load no token chose any expert
    of: the loader fills nothing) has none, and compute waits on nothing: its layer reads
    none of those bytes (issue 48: a fresh CUDA engine's first such load was a KeyError)."""

    def __init__(self) -> None:
        self._copied: dict[int, E] = {}

    def copied(self, slot: int, event: E) -> None:
        self._copied[slot] = event

    def last(self, slot: int) -> E | None:
        return self._copied.get(slot)


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
        self._reader = Reader(files, direct=True)
        self.throttle = Throttle(link_gbps)
        self.tier = tier
        self._stream = torch.cuda.Stream(device=device)
        self._arena: HostArena | None = None
        self._staging: list[torch.Tensor] = []
        self._staged: list[torch.cuda.Event | None] = []  # per staging buffer: its last copy
        self._fills = 0
        self._copied: CopyEvents[torch.cuda.Event] = CopyEvents()  # per slot id: its last copy
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
        host, disk = self.tier.staged(load, self._reader) if self.tier else (None, 0)
        k, pinned, waited = None, True, 0.0
        if host is not None:
            staging = host  # pinned: the tier copies straight from its own buffer
        elif self._staging and load.nbytes <= self._staging[0].numel():
            k = self._fills % len(self._staging)
            self._fills += 1
            staging = self._staging[k]
            previous = self._staged[k]
            if previous is not None:
                w0 = time.perf_counter()
                previous.synchronize()  # free once its last copy is done (a blocking wait)
                waited = time.perf_counter() - w0  # the copy's time, not the disk's
            disk = self._reader.read(load, staging, self.tier, settle=False)
        else:  # a resident load bigger than the staging: once, through pageable memory
            staging, pinned = aligned_empty(load.nbytes), False
            disk = self._reader.read(load, staging, self.tier, settle=False)
        t1 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            done = self._computed.get(slot)
            if done is not None:
                self._stream.wait_event(done)  # previous occupant's kernels have finished
            start = torch.cuda.Event(enable_timing=True, blocking=True)
            end = torch.cuda.Event(enable_timing=True, blocking=True)
            start.record(self._stream)
            for dst, src, n in moves(load):  # each piece to its aligned offset
                region[dst : dst + n].copy_(staging[src : src + n], non_blocking=pinned)
            end.record(self._stream)
        self._copied.copied(slot, end)
        self._timed.append((start, end))
        if k is not None:
            self._staged[k] = end
        self.throttle.wait(load.weight_bytes, t0)
        return FillTimes(t1 - t0 - waited, 0.0, load.weight_bytes, disk)

    def prefetch(self, load: Load) -> None:
        self._reader.prefetch(load, self.tier)

    def wait_ready(self, slot: int) -> None:
        event = self._copied.last(slot)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

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
