"""Transformer block math in torch, matching mlx-lm's Llama / Mistral / Qwen2 / Qwen3.

The block is computed in *parts* so a layer can be streamed in pieces (plan.py's `Part`): a
whole op in one part adds its output into the residual; a cut one is cut by the rows of its
matrices: attention over a range of KV heads writes those heads' output, o_proj's rows then
add their columns of the residual; gate/up rows write their columns of the activation,
down_proj's rows add theirs. Each residual value takes one addition, as in an uncut layer.
Activations are bounded by `chunk` tokens: attention queries and the MLP run in token chunks.
Shapes: T = new tokens, S = start + T (keys), H = hidden, D = head_dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.kernels.rope import apply_rope, rms_norm
from tandem.nodes.prefill.kernels.sinks import sink_attention


@dataclass
class LayerState:
    """Per-layer activations kept across the layer's parts."""

    k: torch.Tensor  # [1, n_kv, S, D]: prefix keys then this request's (post-RoPE)
    v: torch.Tensor  # [1, n_kv, S, D]
    x_norm: torch.Tensor | None = None  # [T, H]: the current op's normalised input
    out: torch.Tensor | None = None  # a cut op's kept output: [T, nq·D] heads' or [T, I] act


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
    with_o: bool = True,
    window: int | None = None,
    post_norm: torch.Tensor | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Attention over KV heads [kv_lo, kv_hi): writes their K/V; `with_o` (all heads, o_proj
    among w) adds o_proj of the output into h, else keeps the heads' output in `state.out`
    for the o parts (`out_rows_part`). `window`: a sliding layer's, each query attending to
    that many positions up to its own; `post_norm`: the weight of an RMSNorm of o_proj's
    output before it joins h (Gemma 3). The scale is `attention_scale(spec)`. `reduce`: a
    rank's heads with o_proj's columns for them (`ranks/`): their output summed over the
    ranks, then the bias and the norm, then into h."""
    T, D = h.shape[0], spec.head_dim
    if first:
        state.x_norm = rms_norm(h, w["input_layernorm.weight"], spec.rms_norm_eps)
        if not with_o:
            state.out = torch.empty(T, spec.num_heads * D, dtype=h.dtype, device=h.device)
    x = state.x_norm
    assert x is not None
    q, k, v = _qkv(spec, x, w, kv_hi - kv_lo)
    _rope_into(state, q, k, v, kv_lo, start, rope, chunk)
    rep = spec.num_heads // spec.num_kv_heads
    # all queries at once where a fused kernel keeps attention memory linear; elsewhere, and
    # in a window (whose band would be a [T, S] mask), query chunks bound the score matrix
    fused = fused_attention(h.device.type, h.element_size(), D) and window is None
    q_chunk = T if fused else chunk
    scale = attention_scale(spec)
    sinks = w["self_attn.sinks"][kv_lo * rep : kv_hi * rep] if spec.attention_sinks else None
    for c0 in range(0, T, q_chunk):
        c1 = min(T, c0 + q_chunk)
        heads = _attend(q, state, kv_lo, kv_hi, start, c0, c1, scale, window, sinks)  # [c,nq,D]
        if with_o and reduce is not None:  # a rank's heads: its share of o_proj's output
            r = reduce(heads.reshape(c1 - c0, -1) @ w["self_attn.o_proj.weight"].t())  # [c, H]
            if spec.output_bias:
                r += w["self_attn.o_proj.bias"]
            h[c0:c1] += r if post_norm is None else rms_norm(r, post_norm, spec.rms_norm_eps)
        elif with_o and spec.output_bias:  # o_proj with its bias, then into the residual
            o, bias = w["self_attn.o_proj.weight"], w["self_attn.o_proj.bias"]
            h[c0:c1] += torch.addmm(bias, heads.reshape(c1 - c0, -1), o.t())
        elif with_o and post_norm is None:  # o_proj: the last weight asked for (see dequant)
            h[c0:c1].addmm_(heads.reshape(c1 - c0, -1), w["self_attn.o_proj.weight"].t())
        elif with_o:
            r = heads.reshape(c1 - c0, -1) @ w["self_attn.o_proj.weight"].t()  # [c, H]
            h[c0:c1] += rms_norm(r, post_norm, spec.rms_norm_eps)
        else:
            assert state.out is not None
            kept = state.out[c0:c1, kv_lo * rep * D : kv_hi * rep * D]
            kept.view(heads.shape).copy_(heads)


def attention_scale(spec: ModelSpec) -> float:
    """Scores' scale: 1/sqrt(head_dim), or Gemma's 1/sqrt(query_pre_attn_scalar)."""
    scalar = spec.query_pre_attn_scalar
    return (scalar if scalar is not None else spec.head_dim) ** -0.5


def _qkv(
    spec: ModelSpec, x: torch.Tensor, w: Mapping[str, torch.Tensor], nkv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [nq, T, D], k and v [nkv, T, D] of `nkv` KV heads' rows of the projections (q and k
    RMS-normed per head where the family does so); before RoPE."""
    T, D = x.shape[0], spec.head_dim
    nq = nkv * (spec.num_heads // spec.num_kv_heads)
    q = F.linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
    k = F.linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
    v = F.linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
    q = q.view(T, nq, D).transpose(0, 1)
    k = k.view(T, nkv, D).transpose(0, 1)
    v = v.view(T, nkv, D).transpose(0, 1)
    if spec.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], spec.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], spec.rms_norm_eps)
    return q, k, v


def _rope_into(
    state: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lo: int,
    start: int, rope: tuple[torch.Tensor, torch.Tensor], chunk: int,
) -> None:  # fmt: skip
    """RoPE on q (in place) and k, in token chunks (its float32 copies stay chunk-sized); k and
    v land in the layer's K/V at positions start.. of heads kv_lo.."""
    T, kv_hi = q.shape[1], kv_lo + k.shape[0]
    cos, sin = rope
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        q[:, c0:c1] = apply_rope(q[:, c0:c1], cos[c0:c1], sin[c0:c1])
        k_rot = apply_rope(k[:, c0:c1], cos[c0:c1], sin[c0:c1])
        state.k[0, kv_lo:kv_hi, start + c0 : start + c1] = k_rot
    state.v[0, kv_lo:kv_hi, start:] = v


def _attend(
    q: torch.Tensor, state: LayerState, kv_lo: int, kv_hi: int, start: int, c0: int, c1: int,
    scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of queries c0..c1-1 (positions start + c0..) over heads kv_lo..'s keys
    up to the chunk's last query: [c, nq, D], a view. With a `window`, each query attends to
    the `window` positions up to its own: the keys from the first query's window on, under
    a band mask of this chunk only ([c, c + window - 1] at most)."""
    D = q.shape[-1]
    s_end = start + c1  # keys beyond the chunk's last query are masked anyway
    s_lo = 0 if window is None else max(0, start + c0 - window + 1)
    # no explicit boolean mask (it rules the fused kernels out) where causal is enough:
    # plain causal where the queries start at position 0, else causal aligned to the last
    # key (lower right); a window that leaves out keys takes the band
    if window is not None and s_end > window:
        causal: dict[str, object] = {"attn_mask": band_mask(start + c0, start + c1, s_lo, window,
                                                        q.device)}  # fmt: skip
    elif start + c0 == 0:
        causal = {"is_causal": True}
    else:
        causal = {"attn_mask": _causal_lower_right()(c1 - c0, s_end)}
    k = state.k[:, kv_lo:kv_hi, s_lo:s_end]
    v = state.v[:, kv_lo:kv_hi, s_lo:s_end]
    scale = D**-0.5 if scale is None else scale
    if sinks is not None:  # gpt-oss: each head's sink logit in its softmax (`sinks.py`)
        band = causal["attn_mask"] if window is not None and s_end > window else None
        assert band is None or isinstance(band, torch.Tensor)
        out = sink_attention(q[None, :, c0:c1], k, v, sinks, scale, band)
    elif "attn_mask" in causal and isinstance(causal["attn_mask"], torch.Tensor):
        out = band_attention(q[None, :, c0:c1], k, v, causal["attn_mask"], scale)
    else:
        out = F.scaled_dot_product_attention(
            q[None, :, c0:c1], k, v, scale=scale, enable_gqa=True,
            **causal,  # type: ignore[arg-type]
        )  # fmt: skip
    return out[0].transpose(0, 1)  # [1, nq, c, D] -> [c, nq, D]


def band_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
    repeat: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """SDPA of q [1, nq, c, D] over k, v [1, nkv, S, D] under a boolean `mask` [c, S] (a
    sliding window's band): [1, nq, c, D]. On CUDA a mask with GQA leaves SDPA its MATH kernel
    only (flash takes no mask, the efficient kernel no GQA), which holds the scores in
    float32: there (`repeat`, by default on CUDA) the window's keys are repeated to every
    query head, 2 · nq · S · D elements (a window's worth), and the efficient kernel runs it
    (issue 48: Gemma 3's sliding layers ran MATH, ≈0.25 s a pass for a 27B at 4k)."""
    nq, nkv = q.shape[1], k.shape[1]
    if repeat if repeat is not None else q.device.type == "cuda":
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def band_mask(q_lo: int, q_hi: int, k_lo: int, window: int, device: torch.device) -> torch.Tensor:
    """Which keys k_lo..q_hi-1 each query q_lo..q_hi-1 attends to in a sliding window:
    q - window < k <= q (as mlx-lm's `create_causal_mask`). [q_hi - q_lo, q_hi - k_lo] bool."""
    q = torch.arange(q_lo, q_hi, device=device)[:, None]
    k = torch.arange(k_lo, q_hi, device=device)[None]
    return (k <= q) & (k > q - window)


def mlp_part(
    spec: ModelSpec,
    h: torch.Tensor,
    state: LayerState,
    w: Mapping[str, torch.Tensor],
    first: bool,
    chunk: int,
    lo: int = 0,
    hi: int | None = None,
    with_down: bool = True,
    norm: str = "post_attention_layernorm.weight",
    post_norm: torch.Tensor | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """SwiGLU over intermediate features [lo, hi), in token chunks: `with_down` (all of them,
    down_proj among w) adds down_proj of the activation into h, else keeps the activation's
    columns in `state.out` for the down parts (`out_rows_part`). `norm`: the input norm's
    weight in w; a `gelu_pytorch_tanh` spec gates with GELU-tanh (Gemma 3), whose
    `post_norm` weight norms down_proj's output before it joins h. `reduce`: a rank's rows
    with down_proj's columns for them (`ranks/`), summed over the ranks before the norm."""
    if first:
        state.x_norm = rms_norm(h, w[norm], spec.rms_norm_eps)
        if not with_down:
            T, inter = h.shape[0], spec.intermediate_size
            state.out = torch.empty(T, inter, dtype=h.dtype, device=h.device)
    x = state.x_norm
    assert x is not None
    hi = spec.intermediate_size if hi is None else hi
    for c0 in range(0, h.shape[0], chunk):
        xc = x[c0 : c0 + chunk]  # [c, H]
        # each weight asked for right before its use: a quantized one may share its scratch
        gate = _gate(spec, F.linear(xc, w["mlp.gate_proj.weight"]))
        up = F.linear(xc, w["mlp.up_proj.weight"])  # [c, hi - lo]
        if with_down and reduce is not None:
            r = reduce(gate.mul_(up) @ w["mlp.down_proj.weight"].t())  # [c, H]
            h[c0 : c0 + chunk] += (
                r if post_norm is None else rms_norm(r, post_norm, spec.rms_norm_eps)
            )
        elif with_down and post_norm is None:
            act = gate.mul_(up)
            h[c0 : c0 + chunk].addmm_(act, w["mlp.down_proj.weight"].t())
        elif with_down:
            r = gate.mul_(up) @ w["mlp.down_proj.weight"].t()  # [c, H]
            h[c0 : c0 + chunk] += rms_norm(r, post_norm, spec.rms_norm_eps)
        else:
            assert state.out is not None
            torch.mul(gate, up, out=state.out[c0 : c0 + chunk, lo:hi])


def _gate(spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    """The gate's activation, in place where it can be: SiLU, or GELU-tanh (mlx-lm's
    `gelu_approx`) for `gelu_pytorch_tanh`."""
    if spec.hidden_act == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x, inplace=True)


def out_rows_part(
    h: torch.Tensor, state: LayerState, weight: torch.Tensor, lo: int, hi: int, last: bool,
    chunk: int,
) -> None:  # fmt: skip
    """Rows [lo, hi) of a cut op's output matrix (o_proj or down_proj, `weight` [hi - lo, K])
    over the output its earlier parts kept [T, K]: adds residual columns [lo, hi), in token
    chunks. The last one lets the kept output go."""
    kept = state.out
    assert kept is not None
    for c0 in range(0, h.shape[0], chunk):
        h[c0 : c0 + chunk, lo:hi].addmm_(kept[c0 : c0 + chunk], weight.t())
    if last:
        state.out = None


FLASH_CAPABILITY = (8, 0)  # flash attention's CUDA kernels: Ampere and later


@functools.cache
def _causal_lower_right() -> Callable[[int, int], object]:
    """torch's lower-right causal bias, imported on first use: its module pulls in
    torch._dynamo (~3 s on a CPU), which a node that never prefills after a prefix skips."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right


def fused_attention(device_type: str, itemsize: int, head_dim: int) -> bool:
    """Whether attention takes all queries at once: on CUDA in half precision with a head of
    at most 256, what flash attention takes (with GQA, and no mask but a causal bias). Else
    SDPA may fall back to its MATH kernel, which holds the whole [heads, T, S] score matrix
    in float32 (an fp32 model, a head of 512, a pre-Ampere card: flash attention needs
    compute capability 8.0): queries then go in chunks, as on a CPU. The card is this
    machine's CUDA device; where there is none (a plan for another machine) it is taken to
    be Ampere or later."""
    if device_type != "cuda" or itemsize != 2 or head_dim > 256:
        return False
    capability = cuda_capability()
    return capability is None or capability >= FLASH_CAPABILITY


@functools.cache
def cuda_capability() -> tuple[int, int] | None:
    """The compute capability of this machine's current CUDA device; None without one."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major, minor
