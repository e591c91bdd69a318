"""The ranks of one prefill node, on torch.distributed (NCCL between CUDA devices, gloo where
the device is the CPU), started by `torchrun` (its environment: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK).

What crosses between them:
- `reduce`: a branch's share summed over the ranks, in place (one all-reduce after each
  attention and each MLP: [T, H] in the compute dtype, float32 for a mixture's sum);
- `to_rank0`: a layer's K/V (or state), the rank's heads with zeros elsewhere, summed into
  rank 0, which hands the layer over;
- `announce`/`receive` (rank 0 → the others, on a gloo group of its own): each pass's prompts
  and their cached prefixes, or the end;
- `gather`: each rank's record of the pass (bytes streamed), for rank 0's `/health`;
- `share`: an object of rank 0's to the others, once (where its events relay listens:
  `events.py`, closed by `close`).

A rank that fails a collective (its peer died) is `RankLost`, and so is the node where a rank's
events connection closes or its heartbeat stops (`events.py`): the pass fails, rank 0 says so to
every request (503) for `LOST_GRACE_S`, then stops itself (gone `LOST_HARD_S` later whatever
it waits on); `torchrun` stops the rest, and every rank dies with its parent.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tandem.nodes.contract.ranks import PrefillRank, PrefillRanks
from tandem.nodes.prefill.batch import Ask
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.prefix_upload import KV, Prefix, State
from tandem.nodes.prefill.ranks.shard import Shard

if TYPE_CHECKING:
    from tandem.nodes.prefill.engine import PrefillEngine
    from tandem.nodes.prefill.ranks.events import EventForwarder, EventRelay

log = logging.getLogger(__name__)

LOST_GRACE_S = 1.0  # a node that lost a rank answers 503 this long, then stops
LOST_HARD_S = 20.0  # and is gone this long after, whatever its stop waits on (a stuck rank)
COMPUTE_TIMEOUT = datetime.timedelta(minutes=5)  # a collective waiting on a stuck peer
IDLE_TIMEOUT = datetime.timedelta(days=7)  # the others wait for rank 0's next pass this long


class RankLost(PrefillError):
    """A rank of this prefill node is gone (its collective failed)."""


def rank_device(device: str | None, local_rank: int) -> str:
    """A rank's device: its local rank's CUDA device where the node's is CUDA (or unsaid and
    CUDA is here), else the CPU."""
    if device not in (None, "cuda", "cpu") and not (device or "").startswith("cuda:"):
        raise PrefillError(f"ranks run on CUDA devices or the CPU, not {device}")
    if device == "cpu":
        return device
    if device is None and not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{local_rank}"


def world_from_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment; None outside it (or for
    a world of one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))


@dataclass
class PassRecord:
    """One rank's share of the last pass (`gather`)."""

    rank: int
    bytes_streamed: int = 0
    reduced_bytes: int = 0  # what its all-reduces carried (its tensors' bytes)
    handover_bytes: int = 0  # its layers' K/V (or states) summed into rank 0
    seconds: float = 0.0  # the pass's wall time
    compute_s: float = 0.0


@dataclass
class Collective:
    """This process's rank among the node's ranks (see the module doc)."""

    shard: Shard
    device: torch.device
    control: Any = None  # the gloo group for prompts and records
    lost: str | None = None
    reduced_bytes: int = 0  # all-reduce bytes this pass
    handover_bytes: int = 0  # summed into rank 0 this pass
    records: list[PassRecord] = field(default_factory=list)  # rank 0: the last pass's, by rank
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _t0: float = 0.0
    stopping: bool = False
    described: list[PrefillRank] = field(default_factory=list)  # every rank's, once built
    relay: EventRelay | EventForwarder | None = None  # the others' events to rank 0's bus

    @classmethod
    def start(
        cls, rank: int, world: int, device: torch.device, backend: str | None = None
    ) -> Collective:
        """Join the node's process group (torchrun's rendezvous in the environment): NCCL
        between CUDA devices, gloo on the CPU (or as `backend` says: gpu-check's two ranks on
        one card)."""
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        backend = backend or ("nccl" if cuda else "gloo")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=COMPUTE_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        log.info("rank %d of %d on %s (%s)", rank, world, device, dist.get_backend())
        return cls(Shard(rank, world), device, control)

    @property
    def rank(self) -> int:
        return self.shard.rank

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        self._run(dist.all_reduce, x)
        self.reduced_bytes += x.numel() * x.element_size()
        return x

    def to_rank0(self, out: KV | State) -> KV | State:
        """A layer's K/V (or state), every rank's share summed into rank 0's copy."""
        if isinstance(out, dict):
            summed = {name: self._sum0(t) for name, t in out.items()}
            return summed
        k, v = out
        return self._sum0(k), self._sum0(v)

    def _sum0(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._run(dist.reduce, t, dst=0)
        self.handover_bytes += t.numel() * t.element_size()
        return t

    def announce(self, asks: Sequence[Ask] | None) -> None:
        """Rank 0: the pass's prompts (and their prefixes) to the other ranks; None: stop."""
        if asks is None:
            self._run(dist.broadcast_object_list, [None], src=0, group=self.control)
            return
        meta = [(a.tokens, a.start, a.request_id, a.kv_format, _shapes(a.prefix)) for a in asks]
        self._run(dist.broadcast_object_list, [meta], src=0, group=self.control)
        for ask in asks:
            for t in _tensors(ask.prefix):
                self._run(dist.broadcast, _bytes_of(t.contiguous()), src=0, group=self.control)

    def receive(self) -> list[Ask] | None:
        """The other ranks: the next pass's prompts from rank 0; None when the node stops."""
        box: list[Any] = [None]
        self._run(dist.broadcast_object_list, box, src=0, group=self.control)
        if box[0] is None:
            return None
        asks = []
        for tokens, start, rid, kv_format, shapes in box[0]:
            prefix = None
            if shapes is not None:
                prefix = [self._received(layer) for layer in shapes]
            asks.append(Ask(tokens, start, prefix, rid, kv_format))
        return asks

    def _received(self, layer: Any) -> Prefix:
        def one(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(shape, dtype=dtype)
            self._run(dist.broadcast, _bytes_of(t), src=0, group=self.control)
            return t

        kind, items = layer
        if kind == "kv":
            return tuple(one(s, d) for s, d in items)  # type: ignore[return-value]
        return {name: one(s, d) for name, s, d in items}

    @contextlib.contextmanager
    def passing(self, asks: Sequence[Ask]) -> Iterator[None]:
        """A pass, on every rank: rank 0 announces its prompts; none leaves the pass mid-way
        (the ranks' collectives go in step: a dropped reader's layers are computed and let
        go). A pass that ends early on any rank (an error; its reader closing it) leaves the
        others out of step: the node is lost."""
        if self.rank == 0:
            self.announce(asks)
        for ask in asks:
            ask.dropped = threading.Event()
        self._t0 = time.perf_counter()
        try:
            yield
        except BaseException as e:
            if not isinstance(e, RankLost):
                self.lose(f"a pass ended early on prefill rank {self.rank} ({e!r})")
            raise

    def recorded(self, bytes_streamed: int, compute_s: float) -> None:
        """At a pass's end, on every rank: its record to rank 0 (`records`)."""
        seconds = time.perf_counter() - self._t0
        self.gather(PassRecord(self.rank, bytes_streamed, seconds=seconds, compute_s=compute_s))

    def describe(self, engine: PrefillEngine, link_gbps: float | None) -> None:
        """Once each rank's engine is built: its device, budget and share, to rank 0."""
        from tandem.nodes.prefill.measure.nvml import link_of

        plan = engine.plan
        me = PrefillRank(
            self.rank, str(engine.device), engine.budget, link_gbps, plan.resident_layers,
            sum(load.weight_bytes for load in plan.loads), plan.resident_bytes,
            plan.ram_bytes, plan.disk_bytes, pcie=link_of(str(engine.device)),
        )  # fmt: skip
        out: list[Any] = [None] * self.shard.world
        self._run(dist.all_gather_object, out, me, group=self.control)
        self.described = out

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the others pass None), over the control group."""
        box = [obj]
        self._run(dist.broadcast_object_list, box, src=0, group=self.control)
        return box[0]

    def health(self) -> PrefillRanks:
        """The ranks as `/health` tells them (rank 0), with each one's last pass."""
        passes = {r.rank: r for r in self.records}
        ranks = []
        for info in self.described:
            last = passes.get(info.rank)
            if last is not None:
                info = replace(
                    info, pass_bytes=last.bytes_streamed,
                    pass_reduced_bytes=last.reduced_bytes, pass_s=last.seconds,
                )  # fmt: skip
            ranks.append(info)
        backend = dist.get_backend() if dist.is_initialized() else ""
        return PrefillRanks(self.shard.world, backend, tuple(ranks), self.lost or "")

    def gather(self, record: PassRecord) -> list[PassRecord] | None:
        """Every rank's record of the pass, at rank 0 (None elsewhere)."""
        record.reduced_bytes, self.reduced_bytes = self.reduced_bytes, 0
        record.handover_bytes, self.handover_bytes = self.handover_bytes, 0
        out: list[Any] | None = [None] * self.shard.world if self.rank == 0 else None
        self._run(dist.gather_object, record, out, dst=0, group=self.control)
        if out is not None:
            self.records = list(out)
        return self.records if out is not None else None

    def _run(self, op: Any, *args: Any, **kwargs: Any) -> None:
        if self.lost is not None:
            raise RankLost(self.lost)
        try:
            op(*args, **kwargs)
        except (RuntimeError, ValueError) as e:  # gloo: a peer's socket closed; NCCL's errors
            raise RankLost(self.lose(f"a prefill rank is gone ({e})")) from e

    def lose(self, why: str) -> str:
        """The ranks are broken: every request from now on is a 503 (`/health` says why) for
        `LOST_GRACE_S`, then this process stops (rank 0: its node's graceful stop), and is
        gone `LOST_HARD_S` later whatever that stop waits on (a collective a frozen rank never
        joins). Nothing while the node stops of its own accord (`stop`)."""
        with self._lock:
            if self.lost is None and not self.stopping:
                self.lost = f"{why}; this prefill node is stopping"
                log.error("%s", self.lost)
                for delay, end in ((LOST_GRACE_S, _terminate), (LOST_HARD_S, _exit)):
                    timer = threading.Timer(delay, end)
                    timer.daemon = True
                    timer.start()
        return self.lost or why

    def stop(self) -> None:
        """Rank 0: the others' `receive` returns None (their engines may close)."""
        self.stopping = True  # the others leaving now is no loss
        if self.lost is None and self.rank == 0:
            with contextlib.suppress(RankLost):
                self.announce(None)

    def close(self) -> None:
        """Leave the group (rank 0: after `stop`), the events relay closed first."""
        if self.relay is not None:
            self.relay.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _shapes(prefix: Sequence[Prefix] | None) -> list[Any] | None:
    if prefix is None:
        return None
    out: list[Any] = []
    for layer in prefix:
        if isinstance(layer, dict):
            out.append(("state", [(n, tuple(t.shape), t.dtype) for n, t in layer.items()]))
        else:
            out.append(("kv", [(tuple(t.shape), t.dtype) for t in layer]))
    return out


def _tensors(prefix: Sequence[Prefix] | None) -> list[torch.Tensor]:
    if prefix is None:
        return []
    return [t for layer in prefix for t in (layer.values() if isinstance(layer, dict) else layer)]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as uint8 (gloo carries every dtype this way)."""
    return t.view(-1).view(torch.uint8)


def _terminate() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _exit() -> None:
    log.error("the prefill node did not stop: it exits now")
    os._exit(1)
