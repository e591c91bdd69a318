"""The dequantizer's cost: a few kernels per matrix (aten ops counted at dispatch), one block
where the caller lends the temporaries' room, and still `mx.dequantize` bit for bit when the
rows go in blocks; and whether resident quantized layers are kept dequantized."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from tandem.nodes.model.index import load_index
from tandem.nodes.model.quant import Quant
from tandem.nodes.prefill.kernels import dequant
from tandem.nodes.prefill.kernels.dequant import dequantize, temp_bytes_per_row
from tandem.nodes.prefill.planning.loads import dequantized_bytes, resident_form
from tandem.nodes.prefill.planning.plan import make_plan
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import MakeTiny
from tests.test_quantized import MX_TO_TORCH, _bits, _torch

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty"}


class Launches(TorchDispatchMode):
    """Counts the aten ops that run a kernel: not views, not bare allocations."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.allocations = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in ALLOCATIONS:
            self.allocations += 1
        elif not func.is_view:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _quantized(rows: int, cols: int, bits: int, group: int, dtype: mx.Dtype) -> tuple:
    rng = np.random.default_rng(rows + bits)
    x = mx.array(rng.standard_normal((rows, cols)).astype(np.float32)).astype(dtype)
    words, scales, biases = mx.quantize(x, group_size=group, bits=bits)
    ref = mx.dequantize(words, scales, biases, group_size=group, bits=bits)
    return _torch(words), _torch(scales), _torch(biases), ref


@pytest.mark.parametrize(
    ("scales", "compute"),
    [(mx.bfloat16, torch.bfloat16), (mx.float16, torch.float32), (mx.float16, torch.bfloat16)],
    ids=["bf16", "fp16-in-fp32", "fp16-in-bf16"],
)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_a_matrix_takes_a_few_kernels(
    bits: int, group: int, scales: mx.Dtype, compute: torch.dtype
) -> None:
    """A 70B-wide matrix (8192 columns; rows kept few for the test's time: the count does
    not grow with them) in one block of at most 12 kernels at every width, values crossing
    words or not, its temporaries in the lent bytes (nothing allocated)."""
    rows, cols, quant = 96, 8192, Quant(bits, group)
    words, s, b, ref = _quantized(rows, cols, bits, group, scales)
    out = torch.empty((rows, cols), dtype=compute)
    temp = torch.empty(rows * temp_bytes_per_row(cols, bits, s.dtype, compute), dtype=torch.uint8)
    with Launches() as count:
        dequantize(words, s, b, quant, compute, out, temp)
    assert len(count.ops) <= 12, count.ops
    assert count.allocations == 0
    if MX_TO_TORCH[scales] == compute:  # else mlx's matmul widens first: see test_quantized
        assert torch.equal(_bits(out), _bits(_torch(ref)))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_blocks_of_what_is_lent_stay_bit_for_bit(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too little lent room and a small BLOCK_BYTES: rows go in blocks, bits unchanged (and
    where the scales are widened, the same bits as in one block)."""
    rows, cols, quant = 37, 512, Quant(bits, 32)
    words, s, b, ref = _quantized(rows, cols, bits, 32, mx.float16)
    whole = dequantize(words, s, b, quant, torch.bfloat16)
    monkeypatch.setattr(dequant, "BLOCK_BYTES", 4096)
    ours = dequantize(words, s, b, quant, torch.float16, temp=torch.empty(8, dtype=torch.uint8))
    assert torch.equal(_bits(ours), _bits(_torch(ref)))
    widened = dequantize(words, s, b, quant, torch.bfloat16, temp=torch.empty(8, dtype=torch.uint8))
    assert torch.equal(_bits(widened), _bits(whole))


@pytest.mark.parametrize("bits", [3, 4, 6])
def test_the_launch_count_does_not_grow_with_rows(bits: int) -> None:
    """Four times the rows, the same kernels: one block when the temporaries fit in what a
    call allocates itself."""
    counts = []
    for rows in (64, 256):
        words, s, b, _ = _quantized(rows, 1024, bits, 32, mx.bfloat16)
        with Launches() as count:
            dequantize(words, s, b, Quant(bits, 32), torch.bfloat16)
        counts.append(len(count.ops))
    assert counts[0] == counts[1] <= 12


def test_resident_quantized_layers_are_kept_dequantized_only_where_the_budget_holds_them(
    tiny_model: MakeTiny,
) -> None:
    """The decision a plan states: dequantized once when the spare bytes hold every resident
    matrix in the compute dtype, partly where they hold some, else packed; a float model's
    stay as they are."""
    shape = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256}
    index = load_index(tiny_model(**shape, quantize=4, group_size=32))
    plan = make_plan(index, 10**9)
    need = sum(dequantized_bytes(index, p, 4) for ld in plan.loads for p in ld.parts)
    assert plan.resident_layers and need > 0
    assert resident_form(index, plan.loads, need, 4) == ("dequantized", need)
    form, some = resident_form(index, plan.loads, need - 1, 4)  # all but the smallest load
    assert form == "partly" and 0 < some < need
    assert resident_form(index, plan.loads, 0, 4) == ("packed", 0)
    streamed = [dataclasses.replace(ld, resident=False) for ld in plan.loads]
    assert resident_form(index, streamed, need, 4) == ("packed", 0)  # nothing resident
    floats = load_index(tiny_model(**shape))
    assert resident_form(floats, make_plan(floats, 10**9).loads, 10**9, 4) == ("packed", 0)
