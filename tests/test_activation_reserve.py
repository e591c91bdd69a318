"""The activation reserve counts what SDPA's MATH kernel really holds (the kernel a CUDA card
without flash attention may take): its float32 scores and its K/V repeated to every query
head, against torch's own allocations, counted op by op on the CPU, within 10%: heads of
8B- and 70B-like models, chunks longer and shorter than the head dim."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tandem.nodes.prefill.planning.activations import math_attention_bytes
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


@pytest.mark.parametrize(
    ("nq", "nkv", "c", "S", "D"),
    [(32, 8, 128, 1024, 128), (64, 8, 64, 2048, 128), (32, 8, 256, 512, 64), (8, 1, 32, 1024, 64)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_math_kernels_peak_is_what_the_reserve_counts(
    nq: int, nkv: int, c: int, S: int, D: int, dtype: torch.dtype
) -> None:
    q = torch.randn(1, nq, c, D, dtype=dtype)
    k = torch.randn(1, nkv, S, D, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(c, S, dtype=torch.bool).tril(S - c)  # the last c queries, causal
    with sdpa_kernel([SDPBackend.MATH]), PeakBytes() as peak:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    counted = math_attention_bytes(nq, nkv, c, S, D, dtype.itemsize)
    assert abs(counted / peak.peak - 1) <= 0.10, (counted, peak.peak)
    if dtype == torch.bfloat16:  # what the reserve counted before: bf16 scores, K/V as is
        assert 2 * nq * c * S * dtype.itemsize < 0.7 * peak.peak
