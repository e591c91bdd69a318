"""Issue 48 item 5 on this CPU: the cost functions `tandem plan` uses predict a 2k-token pass of a
made Qwen3.5 and a made Qwen3.5-MoE within 15% of the engine's measured pass (the median of
three), with the whole model resident and with half of its layers streamed.

Four layers (three linear, one full) of hidden 512: about 0.55 s a pass on the 2-core Xeon
this was written on, three quarters of it in the linear layers' delta rule. The old model
took the MoE's shared expert for attention (28 s predicted) and the mixers for quadratic
attention (the dense model 19% short). The rule runs at the rate
`calibration.measure_recurrence_flops` measures with decays as mlx-lm initialises them; a
made model's own draw of them moves its rate by up to ±15% (float32 denormals on a CPU), which
is most of what is left: +4% (dense) and +10% (MoE) resident, +0% and +4% streamed there.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning import cost

from tests.conftest import MakeTiny
from tests.test_plan_cmd import others_cores

SHAPE = {"layers": 4, "hidden": 512, "heads": 4, "kv_heads": 2, "head_dim": 128,
         "intermediate": 1536, "linear_k_heads": 4, "linear_v_heads": 8, "linear_k_dim": 128,
         "linear_v_dim": 128}  # fmt: skip
MOE = {"experts": 16, "top_k": 4, "moe_intermediate": 256, "shared_intermediate": 512}
TOKENS, BOUND, PASSES = 2048, 0.15, 3
BUSY = 0.25  # cores other processes kept busy: above it, a try proves nothing


def _median_pass(engine: PrefillEngine, ids: list[int]) -> float:
    """Seconds of a warm pass: the median of `PASSES` after one warm-up."""
    list(engine.prefill(ids))
    walls = []
    for _ in range(PASSES):
        t0 = time.perf_counter()
        list(engine.prefill(ids))
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_a_2k_pass_is_predicted_within_15_percent(
    arch: str, tiny_model: MakeTiny, tmp_path: Path
) -> None:
    """Up to three tries in about a minute: a systematic error fails every quiet one; a try
    during which other processes kept a core busy proves nothing, and if every try was one,
    it skips."""
    if not Path("/proc/stat").exists():
        pytest.skip("needs /proc to tell a quiet machine from a busy one")
    index = load_index(tiny_model(arch=arch, **SHAPE, **(MOE if arch.endswith("moe") else {})))
    layers = sum(index.layer_bytes(i) for i in range(index.spec.num_layers))
    budgets = {"resident": None, "half": layers // 2 + (1 << 20)}
    engines = {
        name: PrefillEngine(index, budget=b, device="cpu", host_budget=0)
        for name, b in budgets.items()
    }
    ids = np.random.default_rng(0).integers(0, index.spec.vocab_size, TOKENS).tolist()
    quiet: list[dict[str, float]] = []
    deadline = time.perf_counter() + 60
    try:
        assert engines["half"].plan.n_slots and engines["resident"].plan.granularity == "resident"
        for _ in range(3):
            if time.perf_counter() > deadline:
                break
            hw, busy = others_cores(lambda: cost.calibrate(
                "cpu", index.dtype, index.spec, net_Bps=1e9, mac_tok_s=100,
                directory=tmp_path, disk_bytes=16 << 20, seconds=0.3))  # fmt: skip
            errors = {}
            for name, engine in engines.items():
                measured, noise = others_cores(lambda e=engine: _median_pass(e, ids))
                busy = max(busy, noise)
                predicted = cost.predict(engine.plan, index, TOKENS, hw).wall_s
                errors[name] = predicted / measured - 1
            if busy > BUSY:
                continue
            if all(abs(e) < BOUND for e in errors.values()):
                return
            quiet.append(errors)
    finally:
        for engine in engines.values():
            engine.close()
    if not quiet:
        pytest.skip("other processes kept a core busy through every try: no timing")
    pytest.fail(f"{arch}: predicted off by more than 15% in every quiet try: {quiet}")
