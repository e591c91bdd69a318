"""The layer streamer: a ring of weight slots fed in order by a loader thread, plus a fixed
resident set that stays loaded across requests.

Load j of a request goes to ring slot `j mod n_slots` (loads are consumed in order, so
round-robin *is* the ring). Each slot carries two counters: `filled[s]`, the sequence number
of the load now in it, and `released[s]`, the last load whose compute finished. The loader
waits for `released[s] == j - n_slots` before overwriting; compute waits for
`filled[s] == j` — so no slot is ever reused before its compute is done, however slow or
fast the mover is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tandem.nodes.prefill.dtypes import TORCH_DTYPES
from tandem.nodes.prefill.planning.loads import Load, routed_only
from tandem.nodes.prefill.planning.plan import Plan
from tandem.nodes.prefill.stream.movers import CpuMover, FillTimes, Mover
from tandem.nodes.prefill.stream.routing import Route, Routing

log = logging.getLogger(__name__)


class StreamCancelled(Exception):
    """The request stopped while the loader was waiting."""


@dataclass
class StreamStats:
    load_busy_s: float = 0.0  # loader thread time spent reading and copying
    disk_s: float = 0.0
    h2d_s: float = 0.0
    bytes_streamed: int = 0  # into device memory
    disk_bytes: int = 0  # of those, read from disk (not the host tier)
    experts_streamed: dict[int, int] = field(default_factory=dict)  # layer → experts read
    bytes_by_kind: dict[str, int] = field(default_factory=dict)  # attention, mlp, router, experts
    route_wait_s: float = 0.0  # the loader's time waiting for routers (the link idle)
    slot_wait_s: float = 0.0  # ... and for compute to free a slot (the link not binding)


@dataclass
class LoaderHooks:
    """Callbacks the streamer fires on the loader thread (the engine turns them into events)."""

    on_loading: Callable[[Load, int | None], None] = lambda load, slot: None
    on_ready: Callable[[Load, int | None, FillTimes], None] = lambda load, slot, t: None


@dataclass
class _Ring:
    n: int
    filled: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.filled = [-1] * self.n
        self.released = [-1] * self.n


class LayerStreamer:
    """Owns the weight pool (allocated once) and streams a plan's loads through it."""

    def __init__(self, plan: Plan, mover: Mover) -> None:
        self.plan = plan
        self.mover = mover
        mover.prepare(plan)
        self._ring_mem = [mover.alloc(plan.slot_bytes) for _ in range(plan.n_slots)]
        self._resident_mem = {ld.seq: mover.alloc(ld.nbytes) for ld in plan.loads if ld.resident}
        self._resident_ready: set[int] = set()
        self._streamed = [ld for ld in plan.loads if not ld.resident]
        self._ring_index = {ld.seq: k for k, ld in enumerate(self._streamed)}
        self.last_stats = StreamStats()

    @property
    def pool_bytes(self) -> int:
        return self.plan.pool_bytes

    def slot_of(self, load: Load) -> int | None:
        """Ring slot index of a streamed load; None for a resident one."""
        k = self._ring_index.get(load.seq)
        return None if k is None else k % self.plan.n_slots

    @contextmanager
    def stream(
        self,
        hooks: LoaderHooks | None = None,
        synchronous: bool = False,
        route: Route = True,
        expect_all: bool = False,
    ) -> Iterator[_Run]:
        """Yield a run: iterate it for (load, weight views) in plan order, each ready to
        compute on, and `release(load)` as soon as the load's compute is queued — the loader
        may then refill its slot. (A load not released by then is released when the next one
        is asked for.) `synchronous=True` loads each load only when asked for it, so no copy
        overlaps compute (the bench's `compute_s` denominator). `route=False`: a routed
        load is read whole, without waiting for its router (a pass that computes nothing);
        True: its chosen experts, where the routers' counts and the cost say to wait for
        them (`Routing`; `expect_all`: before any router, the prompt's tokens are expected to
        choose nearly all); "always": always.
        """
        run = _Run(self, hooks or LoaderHooks(), synchronous, route, expect_all)
        try:
            yield run
        finally:
            run.stop()

    def load_only(self, hooks: LoaderHooks | None = None) -> StreamStats:
        """Stream every load through the pool with compute switched off (bench `load_s`)."""
        with self.stream(hooks, route=False) as it:
            for _ in it:
                pass
        return self.last_stats

    def views(self, load: Load) -> dict[str, torch.Tensor]:
        """Typed views into the load's memory, keyed `"{op}:{lo}:{short name}"`."""
        mem = self._memory(load)
        views: dict[str, torch.Tensor] = {}
        offsets = iter(load.offsets)
        for part in load.parts:
            for piece in part.pieces:
                off = next(offsets)
                raw = mem[off : off + piece.nbytes]
                dtype = TORCH_DTYPES[piece.entry.dtype]
                views[f"{part.op}:{part.lo}:{piece.key}"] = raw.view(dtype).view(piece.shape)
        return views

    def slot_id(self, load: Load) -> int:
        """The mover's key for a load's memory: ring slots are 0..n-1, resident loads < 0."""
        slot = self.slot_of(load)
        return -1 - load.seq if slot is None else slot

    def _memory(self, load: Load) -> torch.Tensor:
        if load.resident:
            return self._resident_mem[load.seq]
        slot = self.slot_of(load)
        assert slot is not None
        return self._ring_mem[slot]

    def close(self) -> None:
        self.mover.close()
        self._ring_mem.clear()
        self._resident_mem.clear()


# what a part streams, by kind (`StreamStats.bytes_by_kind`): what routing saved shows there
PART_KINDS = {"attn": "attention", "qkv": "attention", "o": "attention", "gate_up": "mlp",
              "down": "mlp", "linear": "attention", "shared": "mlp"}  # fmt: skip

DEVICE_NICE = 5  # the compute thread: below a node's event loop, which sends the K/V
LOADER_NICE = CpuMover.loader_nice  # a CPU loader: below compute, its reads wait for the gaps


def lower_this_thread(nice: int) -> None:
    """Run the calling thread, and the threads it starts from now on, at niceness `nice`.

    The loader's reads then wait for the gaps instead of stalling a parallel kernel, and
    compute yields to the event loop that sends finished layers. (A CUDA copy is DMA; this
    matters for the host side, and most on a small CPU; a CUDA loader is the critical path and
    keeps its priority: `Mover.loader_nice`.) Elsewhere: normal priority."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def part_weights(views: dict[str, torch.Tensor], op: str, lo: int) -> dict[str, torch.Tensor]:
    """The views of one part, keyed by the tensor's short name."""
    prefix = f"{op}:{lo}:"
    return {k[len(prefix) :]: v for k, v in views.items() if k.startswith(prefix)}


class _Run:
    """One pass over the plan: a loader thread ahead of the consuming (compute) thread."""

    def __init__(
        self,
        streamer: LayerStreamer,
        hooks: LoaderHooks,
        synchronous: bool,
        route: Route = True,
        expect_all: bool = False,
    ) -> None:
        self.s = streamer
        self.hooks = hooks
        self.synchronous = synchronous
        self.ring = _Ring(max(streamer.plan.n_slots, 1))
        self.cond = threading.Condition()
        self.asked = -1  # synchronous mode: highest seq the consumer asked for
        self.ready: set[int] = set()
        self.error: BaseException | None = None
        self.cancelled = False
        self.stats = StreamStats()
        self.routing = Routing(route, nearly_all=expect_all)
        self.early: set[int] = set()  # loads read ahead of their turn, while a router ran
        self.thread = threading.Thread(target=self._loader, name="tandem-loader", daemon=True)
        self.thread.start()

    def _loader(self) -> None:
        if self.s.mover.loader_nice:
            lower_this_thread(self.s.mover.loader_nice)
        loads = self.s.plan.loads
        plain_after: list[Load | None] = [None] * len(loads)  # the next load not routed
        for j in range(len(loads) - 2, -1, -1):
            plain_after[j] = loads[j + 1] if not loads[j + 1].routed else plain_after[j + 1]
        try:
            for j, load in enumerate(loads):
                if load.seq in self.early:  # filled while an earlier load's router ran
                    continue
                if load.resident and load.seq in self.s._resident_ready:
                    self._mark_ready(load)
                    continue
                with self.cond:
                    t0 = time.perf_counter()
                    self.cond.wait_for(lambda ld=load: self.cancelled or self._may_fill(ld))
                    self.stats.slot_wait_s += time.perf_counter() - t0
                    if self.cancelled:
                        return
                self.hooks.on_loading(load, self.s.slot_of(load))
                # the disk reads ahead while this load copies (past the experts its router
                # has still to choose: the next layer's attention, while routing runs)
                if (ahead := plain_after[j]) is not None:
                    self.s.mover.prefetch(ahead)
                self._fill(load, self._chosen(load, ahead))
        except StreamCancelled:
            return
        except BaseException as e:  # surfaced on the compute thread
            log.exception("loader failed")
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _fill(self, load: Load, moved: Load | None) -> None:
        """Read `moved` (all or part of `load`, whose `on_loading` has fired) into the load's
        memory; None: nothing to read (no token chose any of its experts)."""
        slot = self.s.slot_of(load)
        if moved is None:
            with self.cond:
                if slot is not None:
                    self.ring.filled[slot] = load.seq
            self._mark_ready(load)
            return
        t0 = time.perf_counter()
        times = self.s.mover.fill(self.s.slot_id(load), self.s._memory(load), moved)
        self.stats.load_busy_s += time.perf_counter() - t0
        self.stats.disk_s += times.disk_s
        self.stats.h2d_s += times.h2d_s
        self.stats.bytes_streamed += times.nbytes
        for part in moved.parts:
            kind = PART_KINDS.get(part.op, part.op)
            n = sum(piece.nbytes for piece in part.pieces)
            self.stats.bytes_by_kind[kind] = self.stats.bytes_by_kind.get(kind, 0) + n
        self.stats.disk_bytes += times.disk_bytes
        if load.resident:
            self.s._resident_ready.add(load.seq)
        with self.cond:
            if slot is not None:
                self.ring.filled[slot] = load.seq
        self.hooks.on_ready(load, slot, times)
        self._mark_ready(load)

    def route(self, layer: int, used: frozenset[int], experts: int) -> None:
        """On the compute thread, once layer `layer`'s router ran: the experts its tokens
        chose (which also decide whether later layers wait for theirs: `Routing.chose`)."""
        with self.cond:
            self.routing.chose(layer, used, experts)
            self.cond.notify_all()

    def _chosen(self, load: Load, ahead: Load | None) -> Load | None:
        """What of `load` to read: a routed load's chosen experts (after waiting for its
        router), else all of it; None when no token chose any of its experts."""
        routing, stats = self.routing, self.stats
        if not load.routed or load.resident or not routing.mode:
            return load
        # on what the layers before this one waited and saved, and whether the link binds
        routing.check_cost(stats.route_wait_s, stats.bytes_streamed, stats.load_busy_s)
        routing.link_binds = stats.slot_wait_s <= stats.load_busy_s
        with self.cond:
            waits = routing.waits or load.layer in routing.routes
        used = self._route_of(load.layer, ahead) if waits else None
        moved = load if used is None else routed_only(load, used)
        routing.saved_bytes += load.weight_bytes - (moved.weight_bytes if moved else 0)
        if moved is not None:
            n = self.stats.experts_streamed.get(load.layer, 0)
            self.stats.experts_streamed[load.layer] = n + len(moved.parts)
        return moved

    def _route_of(self, layer: int, ahead: Load | None) -> frozenset[int] | None:
        """The experts layer `layer`'s tokens chose, once its router ran; None where an
        earlier router (a resident layer's too) chose nearly all of its experts meanwhile:
        then every expert is read at once. Meanwhile `ahead` (the next load that needs no
        router: the next layer's attention) is read as soon as its slot is free, so the link
        works while routing runs; the link's idle time is `route_wait_s`."""
        while True:
            with self.cond:
                t0 = time.perf_counter()
                self.cond.wait_for(
                    lambda a=ahead: self.cancelled or layer in self.routing.routes
                    or not self.routing.waits or self._early(a)
                )  # fmt: skip
                self.stats.route_wait_s += time.perf_counter() - t0
                if self.cancelled:
                    raise StreamCancelled
                if layer in self.routing.routes:
                    return self.routing.routes[layer]
                if not self.routing.waits:
                    return None
            assert ahead is not None
            self.early.add(ahead.seq)
            self.hooks.on_loading(ahead, self.s.slot_of(ahead))
            self._fill(ahead, ahead)
            ahead = None

    def _early(self, ahead: Load | None) -> bool:
        """Whether `ahead` may be read now, before the loads in front of it."""
        if ahead is None or ahead.seq in self.early or self.synchronous:
            return False
        if ahead.resident and ahead.seq in self.s._resident_ready:
            return False
        return self._may_fill(ahead)

    def _may_fill(self, load: Load) -> bool:
        if self.synchronous and load.seq > self.asked:
            return False
        if (slot := self.s.slot_of(load)) is None:
            return True
        previous = (
            self.s._ring_index[load.seq] - self.s.plan.n_slots
        )  # ring position of the slot's previous occupant
        if previous < 0:
            return True
        return self.ring.released[slot] == self.s._streamed[previous].seq

    def _mark_ready(self, load: Load) -> None:
        with self.cond:
            self.ready.add(load.seq)
            self.cond.notify_all()

    def __iter__(self) -> Iterator[tuple[Load, dict[str, torch.Tensor]]]:
        for load in self.s.plan.loads:
            slot = self.s.slot_of(load)
            with self.cond:
                self.asked = load.seq
                self.cond.notify_all()
                self.cond.wait_for(lambda seq=load.seq: seq in self.ready or self.error is not None)
                if self.error is not None:
                    raise self.error
                if slot is not None and self.ring.filled[slot] != load.seq:
                    raise RuntimeError(f"slot {slot} holds load {self.ring.filled[slot]}")
            self.s.mover.wait_ready(self.s.slot_id(load))
            try:
                yield load, self.s.views(load)
            finally:
                self.release(load)

    def release(self, load: Load) -> None:
        """The load's last kernel is queued: its slot may be refilled (idempotent)."""
        slot = self.s.slot_of(load)
        if slot is None or self.ring.released[slot] >= load.seq:
            return
        self.s.mover.mark_done(slot)
        with self.cond:
            self.ring.released[slot] = load.seq
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()
        self.thread.join()
        self.stats.h2d_s += self.s.mover.finish()
        self.s.last_stats = self.stats
