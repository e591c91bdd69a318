"""Qwen3.5's linear-attention mixer (Gated DeltaNet) in torch, as mlx-lm's
`qwen3_5.GatedDeltaNet.__call__` computes it, in token blocks for prefill.

Per block: the projections, a causal depthwise conv over the carried conv rows then SiLU,
q/k/v split, q/k normalised (`normalize_qk`), the gated delta rule from the carried state,
the gated RMSNorm and out_proj. Shapes: T = tokens, H = hidden, c = block tokens,
C = conv_dim = 2·key_dim + value_dim, K = conv_kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from tandem.nodes.model.spec import LinearSpec
from tandem.nodes.prefill.kernels.gated_delta import gated_delta_chunked
from tandem.nodes.prefill.kernels.rope import rms_norm
from torch import Tensor

RULE_CHUNK = 64  # tokens per chunk of the delta rule's parallel form
QK_EPS = 1e-6  # the l2norm eps mlx-lm passes to normalize_qk (added to sum(x^2))


def linear_mixer(
    x: Tensor,
    w: Mapping[str, Tensor],
    lin: LinearSpec,
    eps: float,
    conv_state: Tensor,
    ssm_state: Tensor,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The mixer over a prompt x [T, H] (the layer's normed input, model dtype), `chunk`
    tokens at a time. conv_state [K-1, C] in x's dtype (zeros for a fresh prompt),
    ssm_state [Hv, Dv, Dk] float32. Returns out [T, H] (out_proj's output, before the
    residual) and the states mlx-lm's ArraysCache holds after the prompt: the last K-1 rows
    of concat(conv_state, qkv) and the recurrent state."""
    out = torch.empty_like(x)
    for c0 in range(0, x.shape[0], chunk):
        c1 = min(x.shape[0], c0 + chunk)
        xb, c = x[c0:c1], c1 - c0  # this block [c, H]
        qkv = _ranges(w, "linear_attn.in_proj_qkv", partial(F.linear, xb), -1)  # [c, C]
        z = F.linear(xb, w["linear_attn.in_proj_z.weight"])  # [c, value_dim]
        b = F.linear(xb, w["linear_attn.in_proj_b.weight"])  # [c, Hv]
        a = F.linear(xb, w["linear_attn.in_proj_a.weight"])  # [c, Hv]
        conv_in = torch.cat([conv_state, qkv])  # [K-1+c, C]
        conv_state = conv_in[c:].clone()  # the last K-1 rows
        taps = _ranges(w, "linear_attn.conv1d", lambda m: m, 0)
        mixed = F.silu(_causal_conv(conv_in, taps, lin.conv_kernel))
        q, k, v = mixed.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        q = q.reshape(c, lin.num_k_heads, lin.head_k_dim)
        k = k.reshape(c, lin.num_k_heads, lin.head_k_dim)
        v = v.reshape(c, lin.num_v_heads, lin.head_v_dim)
        q, k = normalize_qk(q, k, lin.head_k_dim**-0.5)
        g = decay(w["linear_attn.A_log"], a, w["linear_attn.dt_bias"])  # [c, Hv] float32
        beta = torch.sigmoid(b)
        y, ssm_state = gated_delta_chunked(q, k, v, g, beta, ssm_state, RULE_CHUNK)
        y = gated_rms_norm(y, z.view(y.shape), w["linear_attn.norm.weight"], eps)
        out[c0:c1] = F.linear(y.reshape(c, lin.value_dim), w["linear_attn.out_proj.weight"])
    return out, conv_state, ssm_state


def _ranges(
    w: Mapping[str, Tensor], module: str, f: Callable[[Tensor], Tensor], dim: int
) -> Tensor:
    """f of `module`'s weight; a rank's share of q, k and v (`module`, `module@k`, `module@v`:
    three row ranges, `ranks/shard.py`) concatenated along `dim`."""
    out = f(w[f"{module}.weight"])
    if f"{module}@k.weight" not in w:
        return out
    return torch.cat([out, f(w[f"{module}@k.weight"]), f(w[f"{module}@v.weight"])], dim=dim)


def _causal_conv(conv_in: Tensor, weight: Tensor, kernel: int) -> Tensor:
    """Depthwise conv without padding: conv_in [K-1+c, C] -> [c, C] in conv_in's dtype,
    out[t] = sum_j weight[:, j] * conv_in[t + j]. weight is (C, K, 1) (mlx) or (C, 1, K)
    (HF): the same bytes, read as (C, K). Sums in float32."""
    taps = weight.reshape(weight.shape[0], kernel).float()  # [C, K]
    c = conv_in.shape[0] - kernel + 1
    acc = conv_in[:c].float() * taps[:, 0]
    for j in range(1, kernel):
        acc += conv_in[j : j + c].float() * taps[:, j]
    return acc.to(conv_in.dtype)


def normalize_qk(q: Tensor, k: Tensor, inv_scale: float) -> tuple[Tensor, Tensor]:
    """mlx-lm's normalize_qk: L2-normalise q/k as an RMS norm with the eps scaled to the
    mean (eps·inv_scale²), then fold Dk^-0.5 into q: q·inv_scale², k·inv_scale."""
    rms_eps = QK_EPS * inv_scale**2
    return (inv_scale**2) * _rms(q, rms_eps), inv_scale * _rms(k, rms_eps)


def _rms(x: Tensor, eps: float) -> Tensor:
    # x: [..., D]; an RMS norm without weight, in float32, back to x's dtype
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def decay(A_log: Tensor, a: Tensor, dt_bias: Tensor) -> Tensor:
    """mlx-lm's compute_g: g = exp(-exp(A_log) · softplus(a + dt_bias)), float32 [c, Hv]."""
    return torch.exp(-torch.exp(A_log.float()) * F.softplus(a + dt_bias).float())


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3NextRMSNormGated with precise_swiglu: silu(z) · rms_norm(y), in float32, cast to
    y's dtype. y, z [..., Dv]."""
    normed = rms_norm(y, weight, eps)
    return (F.silu(z.float()) * normed.float()).to(y.dtype)
