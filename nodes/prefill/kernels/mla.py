"""Multi-head latent attention (DeepSeek V3, Kimi K2) for a prefill, as mlx-lm's
`DeepseekV3Attention` computes it over several tokens.

Per position the layer keeps a latent (`kv_a_proj_with_mqa`'s first kv_lora outputs, RMS-normed)
and one roped key shared by every head (its last rope outputs); that is what crosses the wire
and what mlx-lm's cache holds. For the attention, a compute-bound prefill decompresses: each
head's keys are the latent times its `embed_q` [kv_lora, nope] (joined to the shared rope key),
its values the latent times its `unembed_out` [v, kv_lora] transposed, and SDPA runs over
[heads, S, nope + rope] keys as for any multi-head attention: scores = scale · (q_nope · k_nope +
q_pe · k_pe), what mlx-lm's prefill adds up as its mask. (Absorbing `embed_q` into the queries
instead attends over the latent, kv_lora + rope = 576 wide for every head: 3× the FLOPs of
nope + rope = 192 for DeepSeek V3; it pays in decode, one query, where mlx-lm does it.)

RoPE here turns adjacent pairs (mlx's `traditional=True`), on the last `rope` dims of each
query head and on the shared key. Shapes: T new tokens, S = start + T keys, nh heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.kernels.blocks import LayerState, _causal_lower_right
from tandem.nodes.prefill.kernels.rope import rms_norm

LATENT_EPS = 1e-6  # mlx-lm's q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps says


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x[.., 2i], x[.., 2i+1]) of x [.., T, R] by angles whose cos, sin
    are [T, R/2] (float32): mlx's `traditional` form."""
    xf = x.float().unflatten(-1, (-1, 2))  # [.., T, R/2, 2]
    even, odd = xf[..., 0], xf[..., 1]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def mla_attention(
    spec: ModelSpec,
    h: torch.Tensor,
    state: LayerState,
    w: Mapping[str, torch.Tensor],
    start: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    chunk: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """The layer's attention over h [T, H], added into h: its latent and rope key of the new
    positions written to state.k [1, 1, S, kv_lora] and state.v [1, 1, S, rope] (positions
    0..start-1 there already), queries in chunks of `chunk`. `rope`: cos, sin [T, rope/2].
    The heads are those `w` holds (all, or a rank's: `reduce` then sums o_proj's output over
    the ranks before its bias and the residual)."""
    mla = spec.mla
    assert mla is not None
    T, nope = h.shape[0], mla.nope_dim
    x = rms_norm(h, w["input_layernorm.weight"], spec.rms_norm_eps)
    if mla.q_lora_rank:
        qa = F.linear(x, w["self_attn.q_a_proj.weight"], w.get("self_attn.q_a_proj.bias"))
        qa = rms_norm(qa, w["self_attn.q_a_layernorm.weight"], LATENT_EPS)
        q = F.linear(qa, w["self_attn.q_b_proj.weight"])
    else:
        q = F.linear(x, w["self_attn.q_proj.weight"])
    nh = q.shape[-1] // mla.q_dim
    q = q.view(T, nh, mla.q_dim).transpose(0, 1)  # [nh, T, nope + rope]
    kv = F.linear(x, w["self_attn.kv_a_proj_with_mqa.weight"],
                  w.get("self_attn.kv_a_proj_with_mqa.bias"))  # fmt: skip
    latent = rms_norm(kv[:, : mla.kv_lora_rank], w["self_attn.kv_a_layernorm.weight"], LATENT_EPS)
    cos, sin = rope
    q = torch.cat([q[..., :nope], rope_pairs(q[..., nope:], cos, sin)], dim=-1)
    state.k[0, 0, start:] = latent
    state.v[0, 0, start:] = rope_pairs(kv[:, mla.kv_lora_rank :], cos, sin)
    keys, values = _decompressed(spec, state, w)  # [1, nh, S, nope + rope], [1, nh, S, v]
    scale = spec.query_pre_attn_scalar**-0.5 if spec.query_pre_attn_scalar else mla.q_dim**-0.5
    out = torch.empty(T, nh * mla.v_dim, dtype=h.dtype, device=h.device)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        s_end = start + c1  # keys past the chunk's last query are masked anyway
        mask = {"is_causal": True} if start + c0 == 0 else {
            "attn_mask": _causal_lower_right()(c1 - c0, s_end)
        }  # fmt: skip
        heads = F.scaled_dot_product_attention(
            q[None, :, c0:c1],
            keys[:, :, :s_end],
            values[:, :, :s_end],
            scale=scale,
            **mask,  # type: ignore[arg-type]
        )  # fmt: skip  [1, nh, c, v]
        out[c0:c1] = heads[0].transpose(0, 1).reshape(c1 - c0, -1)
    if reduce is None:
        h += F.linear(out, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))
        return
    r = reduce(F.linear(out, w["self_attn.o_proj.weight"]))
    h += r if "self_attn.o_proj.bias" not in w else r + w["self_attn.o_proj.bias"]


def _decompressed(
    spec: ModelSpec, state: LayerState, w: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's keys [1, nh, S, nope + rope] and values [1, nh, S, v] from the layer's
    latents and rope keys so far."""
    mla = spec.mla
    assert mla is not None
    latent, k_pe = state.k[0], state.v[0]  # [1, S, kv_lora], [1, S, rope]
    if "self_attn.kv_b_proj.weight" in w:  # DeepSeek's: each head's nope rows, then its v rows
        up = w["self_attn.kv_b_proj.weight"].view(-1, mla.nope_dim + mla.v_dim, mla.kv_lora_rank)
        k_up, v_up = up[:, : mla.nope_dim], up[:, mla.nope_dim :]  # [nh, nope|v, kv_lora]
        k_nope = latent @ k_up.transpose(-1, -2)
    else:  # mlx-lm's: embed_q [nh, kv_lora, nope], unembed_out [nh, v, kv_lora]
        k_nope = latent @ w["self_attn.embed_q.weight"]
        v_up = w["self_attn.unembed_out.weight"]
    values = latent @ v_up.transpose(-1, -2)  # [nh, S, v]
    rope = k_pe.expand(values.shape[0], -1, -1)  # [nh, S, rope]
    return torch.cat([k_nope, rope], dim=-1)[None], values[None]


def decompressed_bytes(spec: ModelSpec, positions: int, itemsize: int) -> int:
    """Device bytes of a latent layer's decompressed keys and values over `positions`."""
    mla = spec.mla
    assert mla is not None
    return spec.num_heads * positions * (mla.q_dim + mla.v_dim + mla.nope_dim) * itemsize
