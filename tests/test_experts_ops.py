"""A load of k chosen experts costs O(1) aten ops, not O(k) (issue 48 item 4): one gather of
their tokens, their matrices stacked (MLX-quantized ones dequantized in one call), three
grouped GEMMs, one scatter. Counted at dispatch during real passes of made Qwen3-MoE models,
float and 4-bit, with prompts that choose few and many experts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.families import qwen3_moe
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import MakeTiny

OPS_PER_LOAD = 60  # whatever k: a few dozen


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("quantize", "budget"), [(None, "roomy"), (4, "packed"), (4, "streamed")]
)  # resident whole layers: float, and 4-bit dequantized each pass; streamed loads of experts
def test_a_load_of_experts_takes_a_few_dozen_ops_whatever_it_chose(
    quantize: int | None, budget: str, tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(arch="qwen3_moe", layers=4, experts=16, top_k=2, hidden=64,
                       moe_intermediate=64, quantize=quantize)  # fmt: skip
    index = load_index(model)
    seen: list[tuple[int, int]] = []  # (experts with tokens, ops)
    real = qwen3_moe.compute_experts

    def counted(p: Any, parts: Any, views: Any, state: Any, h: Any) -> None:
        r = state.routes
        chosen = sum(r.starts[pt.lo + 1] > r.starts[pt.lo] for pt in parts)
        with _Ops() as ops:
            real(p, parts, views, state, h)
        seen.append((chosen, ops.count))

    monkeypatch.setattr(qwen3_moe, "compute_experts", counted)
    engine = PrefillEngine(index, budget=_budget(index, budget), device="cpu")
    engine.route_experts = "always"  # what the routers chose, whatever waiting costs here
    try:
        for n in (1, 3, 64):
            list(engine.prefill(np.random.default_rng(n).integers(0, 512, n).tolist()))
    finally:
        engine.close()
    ks = {k for k, _ in seen}
    most = 12 if budget != "streamed" else 4  # a streamed load holds a few experts here
    assert min(ks) <= 2 and max(ks) >= most, seen  # few and many experts chosen
    assert all(ops <= OPS_PER_LOAD for _, ops in seen), seen
    few = [ops for k, ops in seen if 0 < k <= 2]
    many = [ops for k, ops in seen if k >= most]
    assert max(many) <= max(few) + 8, seen  # not growing with k


def _budget(index: Any, kind: str) -> int:
    if kind == "roomy":
        return 10**9
    layers = sum(index.layer_bytes(i) for i in range(4))
    if kind == "streamed":  # loads of 5 experts, and scratch for them side by side
        return int(layers * 0.7)
    roomy = PrefillEngine(index, budget=10**9, device="cpu").plan  # the same plan, packed
    return roomy.device_bytes - roomy.resident_float_bytes + roomy.reserve_bytes + 1


def test_the_padded_bmm_gives_the_grouped_gemms_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the card has no grouped GEMM (below sm90), a padded `bmm`: the same rows."""
    import torch
    from tandem.nodes.prefill.kernels import experts

    g = torch.Generator().manual_seed(0)
    x, w, counts = torch.randn(10, 16, generator=g), torch.randn(3, 8, 16, generator=g), [3, 5, 2]
    grouped = experts._grouped(x, w, counts)
    monkeypatch.setattr(experts, "_grouped_mm_on", lambda device, dtype: False)
    padded = experts._grouped(x, w, counts)
    want = torch.cat([x[0:3] @ w[0].T, x[3:8] @ w[1].T, x[8:10] @ w[2].T])
    torch.testing.assert_close(padded, want)
    torch.testing.assert_close(grouped, want)
