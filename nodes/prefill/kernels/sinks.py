"""Attention with sinks (gpt-oss): each query head's softmax row takes one more logit, the
head's learned `sink`, which takes probability mass and adds no value (mlx's
`scaled_dot_product_attention(..., sinks=)`).

torch's SDPA takes no sink, so the sink becomes one more key that SDPA's kernels see as any
other: every head gets one extra dimension (padded to a multiple of 8, as flash attention
wants), in which the query holds its head's sink and a key put first holds 1/scale; every other
key holds 0 there, and the sink key's value is zero. The sink key's score is then
scale · sink · (1/scale) = sink (exact where 1/scale is a power of two: head_dim 64, 16, 4), the
other scores are unchanged, and the key stands before position 0, so the lower-right causal
alignment (or the band of a window, with the sink's column added) leaves it visible to every
query. The same fused kernels run as without sinks (flash and GQA on CUDA, no score matrix),
at 72/64 of the FLOPs for gpt-oss's heads and one copy of the keys and values per call.

(The other exact way, the sink-free attention's row log-sum-exp L folded in afterwards as
`out · sigmoid(L − sink)`, needs L, which SDPA does not return; the private kernels that do
take no GQA or lower-right causal alignment.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

PAD = 8  # head dims, with the sink's, go up to a multiple of this


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    band: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [1, nq, c, D] over k, v [1, nkv, S, D] (the c queries are the
    last c of the S key positions), each head's softmax with its `sinks` [nq] logit: [1, nq,
    c, D]. `band` [c, S] bool: a window's mask instead of plain causality."""
    _, nq, c, d = q.shape
    nkv, s = k.shape[1], k.shape[2]
    dp = -(-(d + 1) // PAD) * PAD
    qs = q.new_zeros(1, nq, c, dp)
    qs[..., :d] = q
    qs[..., d] = sinks.to(q.dtype)[:, None]  # [nq, 1]: every query of the head
    ks = k.new_zeros(1, nkv, s + 1, dp)
    ks[:, :, 0, d] = 1.0 / scale
    ks[:, :, 1:, :d] = k
    vs = v.new_zeros(1, nkv, s + 1, dp)
    vs[:, :, 1:, :d] = v
    if band is None:
        mask: object = _causal_lower_right()(c, s + 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                             enable_gqa=True)  # type: ignore[arg-type]  # fmt: skip
    else:
        from tandem.nodes.prefill.kernels.blocks import band_attention

        with_sink = torch.ones(c, s + 1, dtype=torch.bool, device=q.device)
        with_sink[:, 1:] = band
        out = band_attention(qs, ks, vs, with_sink, scale)
    return out[..., :d]


@functools.cache
def _causal_lower_right() -> Callable[[int, int], object]:
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right
