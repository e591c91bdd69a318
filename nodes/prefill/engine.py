"""The prefill engine: token ids in, per-layer post-RoPE K/V out, weights streamed through a
fixed device budget (DESIGN.md data path).

Covers positions `start..start+count-1`; the caller supplies the K/V of `0..start-1` when
`start > 0`. Only the embedding rows of the prompt's tokens are read; the LM head is never
needed. Runs on the calling thread (the node's device thread); the loader runs beside it.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from tandem.nodes.contract.events import EventBus, LinkEvent
from tandem.nodes.contract.http import DEFAULT_CHUNK_TOKENS, KVFormat
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.prefill.batch import Ask, Member
from tandem.nodes.prefill.embedding import Embedding
from tandem.nodes.prefill.errors import PrefillError, PromptTooLong
from tandem.nodes.prefill.families import Pass, family_for
from tandem.nodes.prefill.families.base import Weights
from tandem.nodes.prefill.handover import (
    Handed,
    Handover,
    LayerKV,
    LinearState,
    handover_bytes,
    make_handover,
    quantized_parts,
)
from tandem.nodes.prefill.kernels.rope import inv_freq, rope_tables
from tandem.nodes.prefill.pass_events import PassEvents
from tandem.nodes.prefill.planning.budget import (
    DEFAULT_MAX_PROMPT_TOKENS,
    default_budget,
    default_device,
    exact_reductions,
    indexed_device,
    longest_prompt,
    plan_for_prompts,
    prompt_activations,
)
from tandem.nodes.prefill.planning.loads import ALIGN, Load, Part
from tandem.nodes.prefill.planning.plan import Plan
from tandem.nodes.prefill.planning.ram import HostBudget, beside_tier, request_tokens
from tandem.nodes.prefill.prefix_upload import KV, Prefix, PrefixUpload, State
from tandem.nodes.prefill.ranks.shard import WHOLE, sharded
from tandem.nodes.prefill.resident import ResidentFloats
from tandem.nodes.prefill.stats import ComputeClock, PrefillStats
from tandem.nodes.prefill.stream.host import host_tier
from tandem.nodes.prefill.stream.movers import N_STAGING, Mover, make_mover
from tandem.nodes.prefill.stream.routing import ALL_EXPERTS, Route
from tandem.nodes.prefill.stream.streamer import (
    TORCH_DTYPES,
    LayerStreamer,
    part_weights,
)

if TYPE_CHECKING:  # torch.distributed is imported by a node of several ranks only
    from tandem.nodes.prefill.ranks.collective import Collective

__all__ = [  # what the node, the bench and the cost model take from here
    "DEFAULT_CHUNK_TOKENS", "DEFAULT_MAX_PROMPT_TOKENS", "Handed", "LayerKV", "LinearState",
    "PrefillEngine", "PrefillError", "PrefillStats", "PromptTooLong", "default_budget",
    "default_device", "plan_for_prompts", "prompt_activations", "quantized_parts",
]  # fmt: skip

log = logging.getLogger(__name__)


class PrefillEngine:
    """Layer-streamed prefill of one model on one device."""

    def __init__(
        self,
        model: str | os.PathLike[str] | ModelIndex,
        *,
        budget: int | None = None,
        device: str | torch.device | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        link_gbps: float | None = None,
        events: EventBus | None = None,
        host_budget: HostBudget | None = None,  # the RAM tier: None or 0 off (the commands: auto)
        max_prompt_tokens: int | None = None,
        mover: Callable[[list[str], torch.device, float | None], Mover] = make_mover,
        prefix_cache: HostBudget | None = None,  # the node's prefix cache (None: not sized here)
        collective: Collective | None = None,  # one of several ranks (`ranks/`)
    ) -> None:
        self.index = model if isinstance(model, ModelIndex) else load_index(model)
        self.spec = self.index.spec
        self.device = indexed_device(
            torch.device(device) if device is not None else default_device()
        )
        exact_reductions(self.device)
        self.dtype = TORCH_DTYPES[self.index.dtype]  # compute dtype
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.chunk_tokens = chunk_tokens
        self.events = events or EventBus()
        self.collective = collective
        shard = collective.shard if collective is not None else WHOLE
        # what each layer computes and hands over: this rank's share of it
        self.family = sharded(family_for(self.spec.family), shard)
        # the budget holds the activations of the longest prompt taken, then the weights
        self.max_prompt_tokens = longest_prompt(self.spec, self.device.type, max_prompt_tokens)
        whole_ops = self._activations(self.max_prompt_tokens or 0, 0, cut_ops=False)
        self.budget = (
            budget
            if budget is not None
            else default_budget(self.index, self.device, whole_ops, self.family)
        )
        self.plan: Plan = plan_for_prompts(
            self.index, self.budget, self.max_prompt_tokens, self.device.type, chunk_tokens,
            self.family,
        )  # fmt: skip
        self.activation_reserve = self.plan.reserve_bytes
        files = [str(f) for f in self.index.files]
        moving = mover(files, self.device, link_gbps)
        # RAM taken beside the tier: the staging, or the whole budget where the device is RAM;
        # then what requests hold: the prefix cache, a prompt's handover copies and upload
        cuda = self.device.type == "cuda"
        base = N_STAGING * self.plan.slot_bytes if cuda else self.budget
        self.request_tokens = request_tokens(
            self.max_prompt_tokens, self.spec.max_position_embeddings
        )
        beside, self.prefix_cache_bytes = beside_tier(  # None: the caller sizes its cache
            base, self.spec.kv_bytes_per_token, self.request_tokens, prefix_cache
        )
        self.plan, moving.tier = host_tier(self.plan, host_budget, beside, pin=cuda)
        self.streamer = LayerStreamer(self.plan, moving)
        self.pass_events = PassEvents(self.events, self.streamer)
        # a part's quantized matrices are dequantized here, one part at a time, from a
        # 256-byte boundary (torch's CPU allocator gives 64)
        nbytes = self.plan.scratch_bytes
        scratch = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=self.device)
        self._scratch = scratch[-scratch.data_ptr() % ALIGN :][:nbytes]
        self.embedding = Embedding(self.index, self.device, self.dtype, self._scratch)
        self._freqs = inv_freq(self.spec)
        # MoE: read only the experts a layer's router chose, while waiting for routers pays
        # ("always": even where it does not; False: every expert)
        self.route_experts: Route = True
        floats = bool(self.plan.resident_floats)
        self._floats = ResidentFloats(self.index, self.dtype, self._scratch) if floats else None
        self._handovers: list[Handover] = []  # one per place in a pass, kept across passes
        self.last_stats = PrefillStats()
        log.info("%s", self.plan.describe(self.activation_reserve, self.max_prompt_tokens,
                                          moving.pinned_bytes))  # fmt: skip

    def _activations(self, count: int, start: int, cut_ops: bool | None = None) -> int:
        """Device bytes of activations for `count` new tokens after `start` (0 for none), with
        room for a cut op's kept output where the plan cuts one (or as `cut_ops` says)."""
        cut = self.plan.cuts_ops if cut_ops is None else cut_ops
        itemsize = ITEMSIZE[self.index.dtype]
        return prompt_activations(
            self.spec, count, start, self.chunk_tokens, itemsize, self.device.type, cut
        )

    def check_fits(self, count: int, start: int = 0) -> None:
        """Refuse, before any streaming, a prompt whose activations exceed the reserve."""
        if self.max_prompt_tokens is None:
            return
        need = self._activations(count, start)
        if need > self.activation_reserve:
            raise PromptTooLong(
                f"a prompt of {start + count} tokens needs {need / 2**20:.0f} MiB of activations;"
                f" this node reserves {self.activation_reserve / 2**20:.0f} MiB (prompts up to "
                f"{self.max_prompt_tokens} tokens): raise --max-prompt-tokens and --budget"
            )

    def close(self) -> None:
        if self.collective is not None:  # rank 0 stops the others (whose it is closes it)
            self.collective.stop()
        self.streamer.close()
        for handover in self._handovers:
            handover.close()
        self.embedding.close()

    def check_tokens(self, tokens: Sequence[int]) -> None:
        if len(tokens) == 0:
            raise PrefillError("empty token list")
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
        if bad:
            raise PrefillError(
                f"token id {bad[0]!r} outside the vocabulary [0, {self.spec.vocab_size})"
            )

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        start: int = 0,
        prefix: Sequence[Prefix] | None = None,
        request_id: str | None = None,
        kv_format: KVFormat | None = None,
        synchronous: bool = False,
    ) -> Iterator[Handed]:
        """Yield each layer's handover for `tokens` at positions start.. as soon as it is done
        (a pass of one: `prefill_pass`).

        `prefix[i]` holds layer i's K/V for positions 0..start-1 (a linear layer's: its state
        at position start, `State`). `synchronous=True` has the
        streamer load each load only when compute asks for it (bench `compute_s`).
        """
        ask = Ask(tokens, start, prefix, request_id or uuid.uuid4().hex[:12], kv_format)
        for _, item in self.prefill_pass([ask], synchronous):
            yield item

    def prefill_pass(
        self, asks: Sequence[Ask], synchronous: bool = False
    ) -> Iterator[tuple[int, Handed]]:
        """One pass of the weights for every ask (batch.py): (the ask's place, one of its
        layers' handover) as soon as that layer is done for it. Each ask computes a load while
        it sits in its slot; an ask that is `dropped` is skipped from its next load on, and
        the pass ends once none is left. `last_stats`: the last ask's (the pass's bytes)."""
        for ask in asks:
            self.check_tokens(ask.tokens)
            if ask.start and (ask.prefix is None or len(ask.prefix) != self.spec.num_layers):
                raise PrefillError("start > 0 needs the prefix K/V of every layer")
            self.check_fits(ask.count, ask.start)
        members = [self._member(i, ask) for i, ask in enumerate(asks)]
        clock = ComputeClock(self.device)
        kinds, family = self.spec.layer_kinds, self.family
        count = sum(ask.count for ask in asks)
        # several ranks run every pass in step, to its end (`ranks/collective.py`)
        steps = nullcontext() if self.collective is None else self.collective.passing(asks)
        with torch.inference_mode(), steps, self._stream(members, count, synchronous) as run:
            # the loader is already filling the ring while the prompts' rows are read
            for m in members:
                m.h = self.embedding(m.ask.tokens)  # its rows [T, H] on the device
                rope = rope_tables(self._freqs, m.ask.start, m.ask.count, self.device)
                p = Pass(self.index, m.ask.start, self.chunk_tokens, rope, self._scratch,
                         self.dtype, **self._ranked())  # fmt: skip
                m.p = family.begin(p, m.h)  # its embedding scale, its other kinds' RoPE
            for load, views in run:
                live = [m for m in members if m.live]
                if not live:
                    break
                i = load.layer
                if self._floats is not None and load.seq in self.plan.resident_floats:
                    views = self._floats.views(load, views)
                if load.first_of_layer:
                    for m in live:
                        assert m.p is not None
                        self.pass_events.publish(m.ask.request_id, load, "computing")
                        m.state = family.new_state(m.p, kinds[i], i, m.ask.count, m.prefix_of(i))
                with clock.timing(i):
                    self._compute_load(live, load, views, run)
                run.release(load)  # its kernels are queued: the loader may refill the slot
                if not load.resident:
                    for m in live:
                        self.pass_events.publish(m.ask.request_id, load, "evicted")
                if load.last_of_layer:
                    for m in live:
                        yield from ((m.index, item) for item in m.handover.take())
            for m in members:
                if m.live:
                    yield from ((m.index, item) for item in m.handover.take(last=True))
        per_layer = clock.per_layer(self.spec.num_layers)
        if self.collective is not None:
            self.collective.recorded(self.streamer.last_stats.bytes_streamed, sum(per_layer))
        for m in members:
            m.stats.layer_compute_s = per_layer
            m.stats.compute_busy_s = sum(per_layer)
            m.stats.quantize_s = m.handover.quantize_seconds()
            # the pass's copies were told once, as the first request's (`pass_events.on_ready`)
            self._finish(m.ask.request_id, m.stats, m.t_start, link=m.index == 0)

    def _member(self, index: int, ask: Ask) -> Member:
        """An ask's share of a pass: its stats begun, a handover of its own (the engine keeps
        one per place in a pass), its prefix's upload."""
        while len(self._handovers) <= index:
            self._handovers.append(make_handover(self.device))
        handover = self._handovers[index]
        handover.reset(ask.kv_format)
        handover.reserve(handover_bytes(self.spec, self.dtype.itemsize, ask.count))
        stats, t_start = self._begin(ask.request_id, ask.count, ask.start)
        uploads = None
        if ask.start and ask.prefix:
            uploads = PrefixUpload(ask.prefix, self.device, self.dtype)
        return Member(ask, index, handover, stats, t_start, uploads)

    def _compute_load(
        self, live: list[Member], load: Load, views: dict[str, torch.Tensor], run: Any
    ) -> None:
        """`load` over every live member, part by part; a run of experts (a streamed load of
        them, a resident layer's) at once where the family can: a few dozen ops whatever
        the number chosen."""
        family = self.family
        for experts, run_parts in itertools.groupby(load.parts, lambda pt: pt.op == "experts"):
            parts = list(run_parts)
            if experts and all(
                family.compute_experts(m.p, parts, views, m.h, m.state) for m in live
            ):
                continue
            for part in parts:
                self._compute(live, part, part_weights(views, part.op, part.lo), run)

    def _compute(self, live: list[Member], part: Part, weights: Weights, run: Any) -> None:
        """`part` over every live member; their layer's handover where its attention is done;
        a router's choices, all members' at once, to the loader."""
        used: set[int] | None = None
        kinds, family = self.spec.layer_kinds, self.family
        for m in live:
            assert m.p is not None and m.h is not None and m.state is not None
            if family.compute(m.p, part, weights, m.h, m.state):
                out = family.handover(m.p, kinds[part.layer], part.layer, m.state)
                self._hand_over(m.handover, out, part.layer)
            if (chosen := family.routing(part, m.state)) is not None:
                used = (used or set()) | chosen
        if used is not None:  # the union of the pass's choices crosses the link once
            self._routed(live, run, part.layer, frozenset(used))

    def _stream(
        self, members: list[Member], count: int, synchronous: bool
    ) -> AbstractContextManager[Any]:
        """The streamer's pass, its loads told to every member. MoE: the routers' counts
        decide which experts are read (`Routing`); before the first, the share of experts
        `count` tokens are expected to choose (the plan's curve)."""
        moe = self.spec.moe
        many = moe is not None and moe.expected_share(count) >= ALL_EXPERTS
        hooks = self.pass_events.hooks([m.ask.request_id for m in members])
        return self.streamer.stream(hooks, synchronous, self.route_experts, many)

    def _ranked(self) -> dict[str, Any]:
        """A rank's pass computes with the sum over the ranks and its share (`ranks/`)."""
        c = self.collective
        return {} if c is None else {"reduce": c.reduce, "shard": c.shard}

    def _hand_over(self, handover: Handover, out: KV | State, i: int) -> None:
        """Layer i's handover: K/V (a full layer's quantized where asked; the others cross
        in float), or a linear layer's state. Of several ranks, rank 0 hands over the sum of
        their shares."""
        if self.collective is not None:
            out = self.collective.to_rank0(out)
            if self.collective.rank:
                return
        if isinstance(out, dict):
            handover.state_done(i, out)
        else:
            handover.kv_done(i, *out, self.spec.layer_kinds[i].kind == "full")

    def _routed(self, live: list[Member], run: Any, layer: int, used: frozenset[int]) -> None:
        """Layer `layer`'s router chose `used`: the loader reads only those experts."""
        total = self.spec.moe.num_experts if self.spec.moe else len(used)
        run.route(layer, used, total)
        rids = [m.ask.request_id for m in live]
        self.pass_events.routed(rids, self.plan.loads, layer, used, total)

    def stream_weights(self, request_id: str | None = None) -> PrefillStats:
        """Every load streamed through the ring once, nothing computed (bench `load_s`)."""
        rid = request_id or uuid.uuid4().hex[:12]
        stats, t_start = self._begin(rid, 0, 0)
        with self.streamer.stream(self.pass_events.hooks([rid]), False, route=False) as run:
            for load, _ in run:
                if load.first_of_layer:
                    self.pass_events.publish(rid, load, "computing")
                run.release(load)
                if not load.resident:
                    self.pass_events.publish(rid, load, "evicted")
        self._finish(rid, stats, t_start)
        return stats

    def _begin(self, rid: str, count: int, start: int) -> tuple[PrefillStats, float]:
        """A request's stats so far, its layers announced; (stats, its start time)."""
        plan, dev = self.plan, self.device
        stats = PrefillStats(
            tokens=count, start=start, layers=self.spec.num_layers, budget_bytes=self.budget,
            peak_weight_bytes=plan.device_bytes,
            peak_activation_bytes=self._activations(count, start),
            pinned_bytes=self.streamer.mover.pinned_bytes,
            activation_reserve_bytes=self.activation_reserve,
            resident_layers=list(plan.resident_layers),
        )  # fmt: skip
        self.last_stats = stats
        self.pass_events.queued(rid, self.spec.num_layers, plan.resident_layers)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # this thread's current device: streams, events, kernels
            torch.cuda.reset_peak_memory_stats(dev)
        return stats, time.perf_counter()

    def _finish(self, rid: str, stats: PrefillStats, t_start: float, link: bool = True) -> None:
        """The streamer's side of a finished request's stats (and on CUDA, with `link`, the
        pass's copy event)."""
        stream, dev = self.streamer.last_stats, self.device
        stats.wall_s = time.perf_counter() - t_start
        stats.took(stream)
        if dev.type == "cuda":
            if stream.h2d_s and link:  # per-load copy times exist only once the pass is done
                link = LinkEvent(rid, name="h2d", bytes=stream.bytes_streamed, seconds=stream.h2d_s)
                self.events.publish(link)
            peak = torch.cuda.max_memory_allocated(dev) - self.plan.device_bytes
            stats.peak_activation_bytes = max(0, peak)
