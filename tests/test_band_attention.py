"""A sliding window's band on CUDA (issue 48 item 7): with GQA and a mask SDPA has only its
MATH kernel, so `band_attention` repeats the window's keys to every query head there and the
efficient kernel takes it. The same numbers as the GQA call; the call CUDA gets carries no GQA
(which kernel runs is measured by scripts/gpu-check's `attention` section)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tandem.nodes.prefill.kernels.blocks import band_attention, band_mask
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.mark.parametrize(("nq", "nkv"), [(4, 1), (8, 2), (4, 4)])
def test_repeated_keys_give_the_gqa_calls_numbers(nq: int, nkv: int) -> None:
    g = torch.Generator().manual_seed(nq + nkv)
    window, start, c, D = 16, 40, 12, 32
    k_lo = start - window + 1
    q = torch.randn(1, nq, c, D, generator=g)
    k = torch.randn(1, nkv, start + c - k_lo, D, generator=g)
    v = torch.randn(1, nkv, start + c - k_lo, D, generator=g)
    mask = band_mask(start, start + c, k_lo, window, q.device)
    grouped = band_attention(q, k, v, mask, D**-0.5, repeat=False)
    repeated = band_attention(q, k, v, mask, D**-0.5, repeat=True)
    torch.testing.assert_close(repeated, grouped, rtol=1e-6, atol=1e-6)
    assert band_attention(q, k, v, mask, D**-0.5).equal(grouped)  # the CPU keeps GQA


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.keys: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "attention" in func.__name__:
            self.keys.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def test_the_repeated_call_hands_sdpa_as_many_key_heads_as_query_heads() -> None:
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 2, 9, 16)
    mask = band_mask(5, 9, 0, 6, q.device)
    with _Calls() as calls:
        band_attention(q, k, k, mask, 0.25, repeat=True)
    assert calls.keys and all(shape[1] == 8 for shape in calls.keys), calls.keys
