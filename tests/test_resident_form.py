"""Issue 34 item 2: the plan decides whether a quantized model's resident layers stay packed
(dequantized into the scratch every pass) or are dequantized once, where the budget's spare
bytes hold them; either way the K/V are the same bits."""

from __future__ import annotations

import numpy as np
import torch
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill import resident
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.kernels import dequant

from tests.conftest import MakeTiny

SHAPE = {"layers": 2, "hidden": 128, "heads": 2, "kv_heads": 1, "intermediate": 256}


def test_resident_layers_are_dequantized_once_where_the_budget_holds_them(
    tiny_model: MakeTiny, monkeypatch
) -> None:
    index = load_index(tiny_model(**SHAPE, quantize=4))
    calls = []
    real = dequant.dequantize

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dequant, "dequantize", counting)  # a pass's (DequantizedWeights)
    monkeypatch.setattr(resident, "dequantize", counting)  # the resident ones, once
    tokens = np.arange(24).tolist()
    roomy = PrefillEngine(index, budget=10**9, device="cpu")
    tight = PrefillEngine(index, budget=roomy.plan.device_bytes - roomy.plan.resident_float_bytes
                          + roomy.plan.reserve_bytes + 1, device="cpu")  # fmt: skip
    try:
        assert roomy.plan.resident_form == "dequantized" and roomy.plan.resident_float_bytes > 0
        assert len(roomy.plan.resident_layers) == 2
        assert tight.plan.resident_form == "packed" and tight.plan.resident_float_bytes == 0
        first = list(roomy.prefill(tokens))
        made = len(calls)
        again = list(roomy.prefill(tokens))
        assert made > 0 and len(calls) == made  # the second pass dequantizes nothing
        packed = list(tight.prefill(tokens))
        assert len(calls) > made  # the packed form dequantizes every pass
        for a, b, c in zip(first, again, packed, strict=True):
            assert torch.equal(a.k, b.k) and torch.equal(a.k, c.k) and torch.equal(a.v, c.v)
    finally:
        roomy.close()
        tight.close()


def test_what_the_budget_holds_is_kept_dequantized_largest_first(
    tiny_model: MakeTiny, monkeypatch
) -> None:
    """Issue 48 item 8: where the spare bytes hold some of the resident matrices in float but
    not all, those loads are kept dequantized (the largest first) and the rest stay packed
    (it was all or nothing: a 70B 4-bit on a 4090 dequantized all 80 resident layers every
    pass); the K/V are the same bits."""
    from tandem.nodes.prefill.planning.loads import dequantized_bytes

    index = load_index(tiny_model(**SHAPE, quantize=4))
    roomy = PrefillEngine(index, budget=10**9, device="cpu")
    plan = roomy.plan
    needs = {
        ld.seq: sum(dequantized_bytes(index, p, 4) for p in ld.parts)
        for ld in plan.loads
        if ld.resident
    }
    largest = max(needs, key=lambda s: needs[s])
    assert len([n for n in needs.values() if n]) >= 2
    budget = plan.device_bytes - plan.resident_float_bytes + plan.reserve_bytes
    some = PrefillEngine(index, budget=budget + needs[largest] + 1, device="cpu")
    calls = []
    real = dequant.dequantize

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dequant, "dequantize", counting)
    monkeypatch.setattr(resident, "dequantize", counting)
    tokens = np.arange(24).tolist()
    try:
        assert some.plan.resident_form == "partly"
        assert some.plan.resident_floats == {largest}
        assert some.plan.resident_float_bytes == needs[largest]
        want = list(roomy.prefill(tokens))
        list(some.prefill(tokens))  # its float loads made
        made = len(calls)
        got = list(some.prefill(tokens))
        per_pass = len(calls) - made
        assert per_pass > 0  # the packed ones, every pass
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    finally:
        roomy.close()
        some.close()
