"""Qwen3.5-MoE's experts are read once routed, as Qwen3-MoE's, even where a whole layer fits
a slot (issue 48 item 1: its layers went whole into one load there, every expert crossing the
link each pass: 3.9× the routed floor for a 256-expert model at 8 tokens)."""

from __future__ import annotations

import numpy as np
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.families import family_for
from tandem.nodes.prefill.planning import cost
from tandem.nodes.prefill.planning.work import Hardware

from tests.conftest import MakeTiny

ARGS = {"arch": "qwen3_5_moe", "layers": 4, "experts": 32, "top_k": 2, "moe_intermediate": 32,
        "vocab": 320, "shared_intermediate": 32}  # fmt: skip


def _expert_bytes(index: ModelIndex, layer: int) -> int:
    parts = family_for(index.spec.family).whole_layer(index, layer)
    return sum(piece.nbytes for p in parts if p.op == "experts" for piece in p.pieces)


def test_a_layer_that_fits_a_slot_still_routes_its_experts(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(**ARGS))
    family = family_for(index.spec.family)
    roomy = 4 * max(index.layer_bytes(i) for i in range(4))  # a whole layer fits a slot
    for layer in range(4):
        groups = family.layer_groups(index, layer, roomy, False)
        assert groups is not None and len(groups) >= 2
        assert all(p.op != "experts" for p in groups[0])  # the mixer's load
        assert all(p.op == "experts" for g in groups[1:] for p in g)


def test_a_routed_pass_of_8_tokens_streams_under_half_the_experts(tiny_model: MakeTiny) -> None:
    """The plan predicts, and a pass measures, at most half the experts' bytes at 8 tokens
    (32 experts, top 2: 1 - (30/32)^8 = 40% expected), with room for two whole layers."""
    index = load_index(tiny_model(**ARGS))
    experts = sum(_expert_bytes(index, i) for i in range(4))
    budget = 2 * max(index.layer_bytes(i) for i in range(4)) + 4096
    plan = cost.node_plan(index, budget)
    routed = sum(ld.weight_bytes for ld in plan.loads if ld.routed and not ld.resident)
    assert routed >= 0.5 * experts  # the streamed layers' experts are routed loads
    hw = Hardware("cpu", copy_Bps=1e9, disk_Bps=1e9, flops=1e10, net_Bps=1e9, mac_tok_s=100)
    predicted = cost.predict(plan, index, 8, hw).bytes_per_pass
    assert predicted - (plan.streamed_bytes - routed) <= 0.5 * routed

    engine = PrefillEngine(index, budget=budget, device="cpu")
    engine.route_experts = "always"  # what the routers chose, whatever waiting costs here
    try:
        shares = []
        for seed in range(3):
            ids = np.random.default_rng(seed).integers(0, 320, 8).tolist()
            list(engine.prefill(ids))
            shares += [n / 32 for n in engine.last_stats.experts_streamed.values()]
        assert shares and np.median(shares) <= 0.5, shares
    finally:
        engine.close()
