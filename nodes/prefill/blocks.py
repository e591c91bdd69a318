"""Transformer block math in torch, matching mlx-lm's Llama / Mistral / Qwen2 / Qwen3.

The block is computed in *parts* so a layer can be streamed in pieces: attention over a range
of KV heads adds its o_proj slice into the residual, the MLP over a range of intermediate
columns adds its down_proj slice. A whole layer is simply every part in one load.
Activations are bounded by `chunk` tokens: attention queries and the MLP run in token chunks.
Shapes: T = new tokens, S = start + T (keys), H = hidden, D = head_dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from nodes.model.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., N]; normalise in float32, then scale in the model dtype (as HF and mlx do)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Per-pair rotation frequencies [D/2] (float32), with Llama 3 or linear scaling."""
    d = spec.head_dim
    periods = spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    scaling = spec.rope_scaling
    if scaling is not None and scaling.kind == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelens = 2 * math.pi * periods
        scaled = torch.where(wavelens > low_wavelen, periods * scaling.factor, periods)
        medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
        smooth = (old / wavelens - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smooth_periods = scaled / ((1 - smooth) / scaling.factor + smooth)
        periods = torch.where(medium, smooth_periods, scaled)
    freqs = 1.0 / periods
    if scaling is not None and scaling.kind == "linear":
        freqs = freqs / scaling.factor
    return freqs


def rope_tables(
    freqs: torch.Tensor, start: int, count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [count, D] for positions start..start+count-1 (float32)."""
    pos = torch.arange(start, start + count, dtype=torch.float32, device=device)
    angles = torch.outer(pos, freqs.to(device))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [h, T, D]; rotate_half form == mlx `traditional=False`
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass
class LayerState:
    """Per-layer activations kept across the layer's parts."""

    k: torch.Tensor  # [1, n_kv, S, D]: prefix keys then this request's (post-RoPE)
    v: torch.Tensor  # [1, n_kv, S, D]
    x_norm: torch.Tensor | None = None  # [T, H]: the current op's normalised input
    acc: torch.Tensor | None = None  # [T, H] float32: a sliced op's output, summed over parts


def _add_residual(
    h: torch.Tensor, state: LayerState, c0: int, out: torch.Tensor, first: bool, last: bool
) -> None:
    """Add an op's output for tokens c0.. into the residual h. An op cut in parts sums them in
    float32 and adds once, from its last part (`finish_op`): the residual then takes one
    rounding per op, as in an uncut layer, not one per slice."""
    if (first and last) or h.dtype == torch.float32:
        h[c0 : c0 + out.shape[0]] += out
        return
    if state.acc is None:
        state.acc = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    state.acc[c0 : c0 + out.shape[0]] += out


def _finish_op(h: torch.Tensor, state: LayerState, last: bool) -> None:
    if last and state.acc is not None:
        h += state.acc.to(h.dtype)
        state.acc = None


def attention_part(
    spec: ModelSpec,
    h: torch.Tensor,
    state: LayerState,
    w: Mapping[str, torch.Tensor],
    kv_lo: int,
    kv_hi: int,
    first: bool,
    last: bool,
    start: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    chunk: int,
) -> None:
    """Attention over KV heads [kv_lo, kv_hi): writes their K/V, adds their o_proj slice to h."""
    T, D = h.shape[0], spec.head_dim
    rep = spec.num_heads // spec.num_kv_heads
    if first:
        state.x_norm = rms_norm(h, w["input_layernorm.weight"], spec.rms_norm_eps)
    x = state.x_norm
    assert x is not None
    nq, nkv = (kv_hi - kv_lo) * rep, kv_hi - kv_lo
    q = F.linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
    k = F.linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
    v = F.linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
    q = q.view(T, nq, D).transpose(0, 1)  # [nq, T, D]
    k = k.view(T, nkv, D).transpose(0, 1)  # [nkv, T, D]
    v = v.view(T, nkv, D).transpose(0, 1)
    if spec.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], spec.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], spec.rms_norm_eps)
    cos, sin = rope
    for c0 in range(0, T, chunk):  # RoPE in token chunks: its float32 copies stay chunk-sized
        c1 = min(T, c0 + chunk)
        q[:, c0:c1] = apply_rope(q[:, c0:c1], cos[c0:c1], sin[c0:c1])
        k_rot = apply_rope(k[:, c0:c1], cos[c0:c1], sin[c0:c1])
        state.k[0, kv_lo:kv_hi, start + c0 : start + c1] = k_rot
    state.v[0, kv_lo:kv_hi, start:] = v
    keys = state.k[:, kv_lo:kv_hi]  # [1, nkv, S, D]
    values = state.v[:, kv_lo:kv_hi]
    wo = w["self_attn.o_proj.weight"]  # [H, nq*D]; the last weight asked for (see dequant)
    # CUDA: all queries at once (flash / memory-efficient kernels keep attention memory
    # linear); elsewhere query chunks bound the score matrix.
    q_chunk = T if h.device.type == "cuda" else chunk
    for c0 in range(0, T, q_chunk):
        c1 = min(T, c0 + q_chunk)
        s_end = start + c1  # keys beyond the chunk's last query are masked anyway
        # no explicit boolean mask (it rules the fused kernels out): plain causal where the
        # queries start at position 0, else causal aligned to the last key (lower right)
        if start + c0 == 0:
            causal: dict[str, object] = {"is_causal": True}
        else:
            causal = {"attn_mask": causal_lower_right(c1 - c0, s_end)}
        out = F.scaled_dot_product_attention(
            q[None, :, c0:c1],
            keys[:, :, :s_end],
            values[:, :, :s_end],
            scale=D**-0.5,
            enable_gqa=True,
            **causal,  # type: ignore[arg-type]
        )  # [1, nq, c, D]
        out = out[0].transpose(0, 1).reshape(c1 - c0, nq * D)
        _add_residual(h, state, c0, F.linear(out, wo), first, last)
    _finish_op(h, state, last)


def mlp_part(
    spec: ModelSpec,
    h: torch.Tensor,
    state: LayerState,
    w: Mapping[str, torch.Tensor],
    first: bool,
    last: bool,
    chunk: int,
) -> None:
    """SwiGLU over a range of intermediate columns, added to h in token chunks."""
    if first:
        state.x_norm = rms_norm(h, w["post_attention_layernorm.weight"], spec.rms_norm_eps)
    x = state.x_norm
    assert x is not None
    for c0 in range(0, h.shape[0], chunk):
        xc = x[c0 : c0 + chunk]  # [c, H]
        # each weight asked for right before its use: a quantized one may share its scratch
        gate = F.silu(F.linear(xc, w["mlp.gate_proj.weight"]))
        act = gate * F.linear(xc, w["mlp.up_proj.weight"])  # [c, cols]
        _add_residual(h, state, c0, F.linear(act, w["mlp.down_proj.weight"]), first, last)
    _finish_op(h, state, last)


CUDA_SLACK = (1.25, 256 << 20)  # ×, + bytes: cuBLAS workspaces, allocator rounding, rope tables


def activation_bytes(
    spec: ModelSpec,
    count: int,
    start: int,
    chunk: int,
    itemsize: int,
    fused_attention: bool = False,
) -> int:
    """Upper bound on device bytes of activations while one layer computes, for `count` new
    tokens after `start`. `fused_attention` (CUDA): all queries at once through a fused kernel
    that never holds the score matrix, the previous layer's K/V still on its way to the host,
    and `CUDA_SLACK`; else query chunks of `chunk` with [heads, chunk, S] scores."""
    T, S, H, D = count, start + count, spec.hidden_size, spec.head_dim
    nq, nkv = spec.num_heads, spec.num_kv_heads
    c = min(chunk, T)
    kv = 2 * nkv * S * D * itemsize  # the layer's K/V
    base = 2 * T * H * itemsize + kv + 2 * T * D * 4  # h, x_norm, K/V, rope tables (fp32)
    if itemsize < 4:
        base += T * H * 4  # a sliced op's float32 sum
    qkv = T * (nq + 2 * nkv) * D * itemsize
    rope = 3 * c * nq * D * 4  # float32 copies of one chunk of q
    if fused_attention:
        attn = qkv + max(rope, 2 * T * nq * D * itemsize + T * H * itemsize)  # out, o_proj
        base += kv  # the previous layer's K/V until its copy to the host is done
    else:
        scores = 2 * nq * c * S * itemsize
        attn = qkv + max(rope, scores + c * (nq * D + H) * itemsize)
    mlp = c * (3 * spec.intermediate_size + H) * itemsize
    total = base + max(attn, mlp)
    if fused_attention:
        return int(total * CUDA_SLACK[0]) + CUDA_SLACK[1]
    return total
