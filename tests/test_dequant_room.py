"""The plan lends `dequantize` its temporaries (issue 34): a quantized model's prefill,
resident or streamed, allocates none of its own (no block beyond the budget), and its K/V
are the same bits whatever the plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.kernels import dequant

from tests.conftest import MakeTiny


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes `dequantize` allocated for temporaries (nothing lent, or too little)."""
    made: list[int] = []
    lent_or_new: Callable[..., torch.Tensor] = dequant._lent_or_new

    def counting(temp: Any, per_row: int, rows: int, device: torch.device) -> torch.Tensor:
        out = lent_or_new(temp, per_row, rows, device)
        if out is not temp:
            made.append(out.numel())
        return out

    monkeypatch.setattr(dequant, "_lent_or_new", counting)
    return made


@pytest.mark.parametrize(
    ("share", "bits"), [(None, 4), (2, 4), (2, 3), (2, 6)]
)  # all resident; half of the layers' bytes; the widths whose values cross words (issue 48)
def test_a_quantized_prefill_allocates_no_temporaries(
    share: int | None, bits: int, tiny_model: MakeTiny, allocations: list[int]
) -> None:
    model = tiny_model(arch="qwen3", layers=4, hidden=128, intermediate=256, quantize=bits)
    index = load_index(model)
    budget = None if share is None else sum(map(index.layer_bytes, range(4))) // share
    tokens = np.random.default_rng(3).integers(0, 512, 40).tolist()
    engine = PrefillEngine(model, device="cpu", budget=budget, chunk_tokens=16)
    try:
        assert (engine.plan.n_slots > 0) == (share is not None)
        kv = list(engine.prefill(tokens))
    finally:
        engine.close()
    assert kv and not allocations, allocations


@pytest.mark.parametrize("share", [2, 4])
def test_a_tight_budget_dequantizes_in_blocks_of_rows(
    share: int, tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the scratch holds one matrix at a time, its temporaries still hold a block of
    rows (`plan.TIGHT_TEMP_ROWS`): a block is ~10 kernels, and the one row a block the plan
    lent before took thousands of blocks a pass for this model (14865 at half its bytes,
    5257 at a quarter), hundreds of thousands for a 70B's layer."""
    model = tiny_model(arch="qwen3", layers=4, hidden=512, intermediate=1024, quantize=4)
    index = load_index(model)
    blocks = []
    real = dequant._unpack

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        blocks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dequant, "_unpack", counting)
    budget = sum(map(index.layer_bytes, range(4))) // share
    engine = PrefillEngine(model, device="cpu", budget=budget, chunk_tokens=16)
    try:
        assert engine.plan.granularity == "slice"  # one matrix at a time
        list(engine.prefill(list(range(40))))
    finally:
        engine.close()
    assert 0 < len(blocks) < 400, len(blocks)
