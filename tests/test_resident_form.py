"""Issue 34 item 2: the plan decides whether a quantized model's resident layers stay packed
(dequantized into the scratch every pass) or are dequantized once, where the budget's spare
bytes hold them; either way the K/V are the same bits."""

from __future__ import annotations

import numpy as np
import torch
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill import dequant, resident
from tandem.nodes.prefill.engine import PrefillEngine

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
