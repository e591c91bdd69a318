"""Issue 36: the link works while a router runs, and counts decide when to wait for one.
While a streamed MoE layer's router runs (its experts cannot be chosen yet), the loader reads
the next layer's first load, where the plan leaves its slot free; the planner takes more,
smaller slots for that where they keep the resident set. A long prompt reads every expert at
once; routers' counts turn the waiting off and on (`Routing`). Made fp32 qwen3_moe, CPU."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.contract.events import LayerEvent
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning import cost
from tandem.nodes.prefill.planning.plan import _routing_idles
from tandem.nodes.prefill.stream.routing import Routing
from tandem.nodes.prefill.stream.streamer import _Run

from tests.conftest import MakeTiny
from tests.records import listen

ARGS = {"arch": "qwen3_moe", "layers": 4, "experts": 8, "top_k": 2, "shards": 2}


@pytest.fixture(scope="module")
def moe(tiny_model: MakeTiny) -> Path:
    return tiny_model(**ARGS)


def budget(model: Path) -> int:
    """Two fifths of the layers: every layer streams; a ring that holds a layer's experts
    and two slots more (at a quarter, a layer's experts fill the ring: the link stands)."""
    index = load_index(model)
    return sum(index.layer_bytes(i) for i in range(4)) * 2 // 5


def test_the_plan_leaves_a_slot_for_the_next_layer_while_routing(moe: Path) -> None:
    index = load_index(moe)
    plan = cost.node_plan(index, budget(moe))
    assert any(ld.routed and not ld.resident for ld in plan.loads)
    assert not _routing_idles(plan)
    # the ring positions from a router's load to the next load that needs no router
    ring = [ld for ld in plan.loads if not ld.resident]
    plain = [k for k, ld in enumerate(ring) if not ld.routed]
    gap = max(b - a for a, b in itertools.pairwise(plain) if b > a + 1)
    assert plan.n_slots > gap  # that load's slot is free while compute sits at the router
    assert _routing_idles(replace(plan, n_slots=gap))  # the check itself, with one slot less
    # at half the layers, a free slot would cost the resident layer: the plan keeps it
    half = cost.node_plan(index, sum(index.layer_bytes(i) for i in range(4)) // 2)
    assert half.resident_layers == (0,) and _routing_idles(half)


def loading_order(engine: PrefillEngine, tokens: list[int]) -> tuple[list[Any], list[int]]:
    """(K/V, the layer of each "loading" event in order) of one prefill."""
    seen: list[int] = []

    def loading(event: object) -> None:
        if isinstance(event, LayerEvent) and event.state == "loading":
            seen.append(event.layer)

    stop = listen(engine.events, loading)
    kv = list(engine.prefill(tokens))
    stop()
    return kv, seen


def test_the_next_layer_loads_while_a_router_runs(
    moe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routers made slow (30 ms each): every streamed layer after a routed one starts
    loading before that layer's experts do; the K/V are those of a pass that overlaps
    nothing. Without the read-ahead (the control), the order is the plan's."""
    route = _Run.route

    def slow_route(self: _Run, layer: int, used: frozenset[int], experts: int) -> None:
        time.sleep(0.03)
        route(self, layer, used, experts)

    monkeypatch.setattr(_Run, "route", slow_route)
    engine = PrefillEngine(moe, budget=budget(moe), device="cpu", chunk_tokens=8)
    engine.route_experts = "always"
    tokens = np.random.default_rng(4).integers(0, 512, 4).tolist()
    try:
        streamed = {ld.layer for ld in engine.plan.loads if ld.routed and not ld.resident}
        pairs = [i for i in sorted(streamed) if i + 1 in streamed]
        assert pairs
        kv, order = loading_order(engine, tokens)
        for i in pairs:  # layer i+1's first load, before layer i's last (its experts)
            assert order.index(i + 1) < len(order) - order[::-1].index(i) - 1, order
        reference = list(engine.prefill(tokens, synchronous=True))
        for a, b in zip(kv, reference, strict=True):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        monkeypatch.setattr(_Run, "_early", lambda self, ahead: False)
        _, control = loading_order(engine, tokens)
        assert control == sorted(control)
    finally:
        engine.close()


def test_a_long_prompt_reads_every_expert_without_waiting_for_routers(
    moe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 tokens, top-2 of 8: 1 - (3/4)^64 of the experts are expected in use, so the loader
    reads every layer's experts at once, before its (slow) router has said so."""
    route = _Run.route

    def slow_route(self: _Run, layer: int, used: frozenset[int], experts: int) -> None:
        time.sleep(0.3)
        route(self, layer, used, experts)

    monkeypatch.setattr(_Run, "route", slow_route)
    index = load_index(moe)
    engine = PrefillEngine(moe, budget=budget(moe), device="cpu", chunk_tokens=64)
    try:
        seen: list[LayerEvent] = []
        listen(engine.events, lambda e: seen.append(e) if isinstance(e, LayerEvent) else None)
        list(engine.prefill(np.random.default_rng(5).integers(0, 512, 64).tolist()))
        assert engine.last_stats.route_wait_s == 0
        assert engine.last_stats.experts_streamed == {i: 8 for i in range(4)}
        for i in range(index.spec.num_layers):  # attention and experts, as slots allow
            routed = next(k for k, e in enumerate(seen) if e.state == "routed" and e.layer == i)
            assert sum(e.state == "ready" and e.layer == i for e in seen[:routed]) >= 2
    finally:
        engine.close()


def test_counts_decide_whether_later_layers_wait() -> None:
    """A router that chose nearly all (≥ 90%) of its experts ends the waiting; one that chose
    few (< 50%) turns it back on, where the link binds; in between, the last decision
    stands."""
    routing = Routing(nearly_all=True)  # a long prompt: expected to use nearly all
    assert not routing.waits
    for layer, chose, waits in ((0, 6, False), (1, 3, True), (2, 6, True), (3, 8, False)):
        routing.chose(layer, frozenset(range(chose)), 8)
        assert routing.waits is waits, (layer, chose)
    routing.chose(4, frozenset(range(1)), 8)
    assert routing.waits
    routing.link_binds = False  # compute, not the link, binds: unread experts save nothing
    assert not routing.waits
    routing.link_binds = True
    routing.waiting_pays = False  # routing stopped paying (`check_cost`): counts cannot undo it
    routing.chose(5, frozenset(range(1)), 8)
    assert not routing.waits and not Routing(False).waits and Routing("always", True).waits


@pytest.mark.parametrize("direct", [False, True])
def test_packing_grows_a_load_as_its_layout_would(moe: Path, direct: bool) -> None:
    """`pack` sizes a load by laying out only the new part's pieces after it: the loads are
    those of laying out each load whole at every step."""
    from tandem.nodes.prefill.families.qwen3_moe import moe_parts
    from tandem.nodes.prefill.planning.loads import pack, slot_size

    index = load_index(moe)
    experts = moe_parts(index, 0)[1:]
    for max_bytes in (slot_size(experts[:1], direct), slot_size(experts[:3], direct) + 100):
        loads: list[list[Any]] = []
        for part in experts:  # the whole layout of each grown load
            if loads and slot_size([*loads[-1], part], direct) <= max_bytes:
                loads[-1].append(part)
            else:
                loads.append([part])
        assert pack(experts, max_bytes, direct) == loads
    assert pack(experts, slot_size(experts[:1], direct) - 1, direct) is None
