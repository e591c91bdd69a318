"""Issue 36 item 4: `tandem plan` predicts a MoE model's bytes per pass from the expected
share of experts its tokens choose, 1 - (1 - k/E)^T, checked against measured passes of a
made model, and the simulator waits for a routed load's router."""

from __future__ import annotations

import numpy as np
import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.model.spec import MoeSpec
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning import cost
from tandem.nodes.prefill.planning.work import Hardware

from tests.conftest import MakeTiny

ARGS = {"arch": "qwen3_moe", "layers": 4, "experts": 8, "top_k": 2, "mlp_only_layers": (1,)}


def test_the_expected_share_of_experts() -> None:
    moe = MoeSpec(num_experts=8, experts_per_token=2, intermediate_size=64, norm_topk_prob=True,
                  sparse=(True,))  # fmt: skip
    assert moe.expected_share(0) == 0 and moe.expected_share(1) == pytest.approx(0.25)
    assert moe.expected_share(4) == pytest.approx(1 - 0.75**4) and moe.expected_share(64) > 0.99


def test_the_curve_tracks_measured_passes(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(**ARGS))
    quarter = sum(index.layer_bytes(i) for i in range(4)) // 4
    engine = PrefillEngine(index, budget=quarter, device="cpu")
    engine.route_experts = "always"  # what the routers chose, whatever waiting costs here
    try:
        for tokens in (1, 2, 4, 8):
            shares = []
            for seed in range(4):
                ids = np.random.default_rng(100 + seed).integers(0, 512, tokens).tolist()
                list(engine.prefill(ids))
                shares += [n / 8 for n in engine.last_stats.experts_streamed.values()]
            assert shares  # the sparse layers streamed
            expected = cost.experts_share(index.spec, tokens)
            assert np.mean(shares) == pytest.approx(expected, abs=0.12)
    finally:
        engine.close()


def test_a_short_prompt_is_predicted_to_stream_fewer_bytes(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(**ARGS))
    plan = cost.node_plan(index, sum(index.layer_bytes(i) for i in range(4)) // 4)
    hw = Hardware("cpu", copy_Bps=1e9, disk_Bps=1e9, flops=1e10, net_Bps=1e9, mac_tok_s=100)
    one, many = cost.predict(plan, index, 1, hw), cost.predict(plan, index, 64, hw)
    assert many.bytes_per_pass == plan.streamed_bytes  # every expert
    routed = sum(ld.weight_bytes for ld in plan.loads if ld.routed and not ld.resident)
    assert one.bytes_per_pass == pytest.approx(plan.streamed_bytes - 0.75 * routed, abs=64)
    # a routed load is read only once its router ran: the loader waits for compute
    run = cost.steps(plan, index, 1, hw)
    waiting = [s for s in run if s.routed]
    assert waiting and cost.simulate(run, plan.n_slots) >= cost.simulate(
        [s if not s.routed else cost.Step(s.read_s, s.copy_s, s.compute_s, True) for s in run],
        plan.n_slots,
    )


def test_bench_side_by_side_reads_every_expert_in_its_all_experts_turns(
    tiny_model: MakeTiny, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--vs all-experts` runs routed and all-experts passes in turns on one engine; the
    all-experts turns read every expert even when a router has already run (a short prompt
    computes faster than the loader reads, so its routes are there before its experts)."""
    import json

    from tandem.nodes.prefill.measure import bench

    model = tiny_model(**ARGS)
    index = load_index(model)
    quarter = sum(index.layer_bytes(i) for i in range(4)) // 4
    plan = cost.node_plan(index, quarter)
    args = ["--model", str(model), "--tokens", "2", "--budget", str(quarter), "--repeat", "2"]
    assert bench.main([*args, "--vs", "all-experts", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["all_experts_bytes"] == plan.streamed_bytes  # every expert of every streamed load
    assert 0 < r["routed_bytes"] < r["all_experts_bytes"]
    assert r["vs_all_experts_ratio"] > 0 and r["route_wait_s"] >= 0
    assert bench.main([*args, "--vs", "all-experts"]) == 0
    assert "routed / all" in capsys.readouterr().out
    dense = tiny_model(arch="llama", layers=4)
    assert bench.main(["--model", str(dense), "--budget", "1MB", "--vs", "all-experts"]) == 2


def test_tandem_plan_says_what_experts_a_pass_reads_and_what_stays_resident(
    tiny_model: MakeTiny, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.app.cli.main import main

    model = tiny_model(**ARGS)
    hw = ["--pcie-gbps", "8", "--disk-gbps", "8", "--tflops", "1", "--host-budget", "0"]
    assert main(["plan", "--model", str(model), "--budget", "2MB", "--tokens", "4", *hw]) == 0
    out = capsys.readouterr().out
    assert "top-2 of 8 per token" in out and "1 - (1 - 2/8)^tokens" in out
    assert "resident layers keep all their experts: a fixed set" in out
