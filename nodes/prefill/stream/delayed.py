"""A CPU mover that behaves as the CUDA one does, for the tests (issue 48): what only a GPU
would show of the ring's ordering, shown on any machine.

`DelayedMover.fill` returns once the bytes are in staging (the disk read, as `CudaMover`'s),
and the copy into the slot lands later, on a copier thread of its own, after a random delay;
compute must wait for it (`wait_ready`, on the slot's `CopyEvents`, as CUDA's stream waits on
its event). The slot is poisoned (0xFF bytes: NaN in every float dtype) at `fill`, so a layer
that reads a slot before its copy landed computes NaN, and the engine's tests see it. The copy
waits for the slot's previous occupant's compute (`mark_done`), and a staging buffer is
refilled only once its last copy is done, as on CUDA.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import torch
from tandem.nodes.prefill.planning.loads import Load, moves
from tandem.nodes.prefill.planning.plan import Plan
from tandem.nodes.prefill.stream.host import HostTier, aligned_empty
from tandem.nodes.prefill.stream.movers import N_STAGING, CopyEvents, CpuMover, FillTimes

POISON = 0xFF  # every float dtype's bytes of all ones are NaN

_Copy = tuple[torch.Tensor, torch.Tensor, Load, threading.Event | None, threading.Event]


class DelayedMover(CpuMover):
    """`CpuMover`'s reads, `CudaMover`'s staging and late copies (see the module doc)."""

    def __init__(
        self,
        files: list[str],
        device: torch.device | None = None,
        link_gbps: float | None = None,
        tier: HostTier | None = None,
        delay_s: float = 0.004,  # each copy lands up to this late
        seed: int = 0,
    ) -> None:
        super().__init__(files, link_gbps, device, tier)
        self.delay_s, self._rng = delay_s, random.Random(seed)
        self._events: CopyEvents[threading.Event] = CopyEvents()
        self._computed: dict[int, threading.Event] = {}
        self._staging: list[torch.Tensor] = []
        self._staged: list[threading.Event | None] = []
        self._fills = 0
        self._copies: queue.Queue[_Copy | None] = queue.Queue()
        self._copier = threading.Thread(target=self._copy, name="tandem-copier", daemon=True)
        self._copier.start()

    def prepare(self, plan: Plan) -> None:
        size = max((ld.nbytes for ld in plan.loads if not ld.resident), default=0)
        self._staging = [aligned_empty(size) for _ in range(N_STAGING)] if size else []
        self._staged = [None] * len(self._staging)

    def fill(self, slot: int, region: torch.Tensor, load: Load) -> FillTimes:
        t0 = time.perf_counter()
        host, disk = self.tier.staged(load, self._reader) if self.tier else (None, 0)
        k = None
        if host is not None:
            source = host
        elif self._staging and load.nbytes <= self._staging[0].numel():
            k = self._fills % len(self._staging)
            self._fills += 1
            source = self._staging[k]
            previous = self._staged[k]
            if previous is not None:
                previous.wait()  # free once its last copy is done
            disk = self._reader.read(load, source, self.tier, settle=False)
        else:  # a resident load bigger than the staging
            source = aligned_empty(load.nbytes)
            disk = self._reader.read(load, source, self.tier, settle=False)
        t1 = time.perf_counter()
        region.fill_(POISON)  # what compute reads if it does not wait for the copy
        done = threading.Event()
        self._events.copied(slot, done)
        if k is not None:
            self._staged[k] = done
        self._copies.put((region, source, load, self._computed.get(slot), done))
        self.throttle.wait(load.weight_bytes, t0)
        return FillTimes(t1 - t0, 0.0, load.weight_bytes, disk)

    def _copy(self) -> None:
        """The copier thread: each copy in order, late, after the slot's last compute."""
        while (job := self._copies.get()) is not None:
            region, source, load, computed, done = job
            time.sleep(self._rng.uniform(0, self.delay_s))
            if computed is not None:
                computed.wait()
            for dst, src, n in moves(load):  # each piece to its aligned offset
                region[dst : dst + n].copy_(source[src : src + n])
            done.set()

    def wait_ready(self, slot: int) -> None:
        event = self._events.last(slot)
        if event is not None:
            event.wait()

    def mark_done(self, slot: int) -> None:
        done = threading.Event()
        done.set()  # a CPU's kernels have run when the compute thread gets here
        self._computed[slot] = done

    def close(self) -> None:
        self._copies.put(None)
        self._copier.join()
        super().close()
