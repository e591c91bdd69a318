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


def attention_part(
    spec: ModelSpec,
    h: torch.Tensor,
    state: LayerState,
    w: Mapping[str, torch.Tensor],
    kv_lo: int,
    kv_hi: int,
    first: bool,
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
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    state.k[0, kv_lo:kv_hi, start:] = k
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
        h[c0:c1] += F.linear(out, wo)


def mlp_part(
    spec: ModelSpec,
    h: torch.Tensor,
    state: LayerState,
    w: Mapping[str, torch.Tensor],
    first: bool,
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
        h[c0 : c0 + chunk] += F.linear(act, w["mlp.down_proj.weight"])


def activation_bytes(spec: ModelSpec, count: int, start: int, chunk: int, itemsize: int) -> int:
    """Upper bound on live activation bytes during one layer (the CPU path's estimate)."""
    T, S, H, D = count, start + count, spec.hidden_size, spec.head_dim
    c = min(chunk, T)
    base = 2 * T * H + 2 * spec.num_kv_heads * S * D  # h, x_norm, layer K/V
    attn = T * (spec.num_heads + 2 * spec.num_kv_heads) * D + spec.num_heads * c * S * 2
    mlp = c * (3 * spec.intermediate_size + H)
    return (base + max(attn, mlp)) * itemsize
