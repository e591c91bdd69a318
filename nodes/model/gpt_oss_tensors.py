"""gpt-oss's layer tensors, in either layout its checkpoints come in.

- mlx-lm's (mlx-community's builds): experts stacked per projection,
  `mlp.experts.{gate,up,down}_proj.weight` [E, out, in] with `.bias` [E, out], float or
  MLX-quantized (`.scales`, and `.biases` where affine);
- OpenAI's (Hugging Face): `mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 (MXFP4
  values, gate and up rows interleaved), `_scales` [E, 2I, H/32] uint8, `_bias` [E, 2I], and
  `down_proj_*` alike. Read as mlx-lm's `sanitize` reads them: the blocks are the MXFP4 words
  [E, rows, cols/8] (uint32, little-endian: the same bytes), named `gate_up_proj.weight`,
  `.scales`, `.bias`: the fused layout ("fused"), whose gate rows are the even ones.

The attention's q/k/v/o have biases, `self_attn.sinks` [heads] a logit per query head; the
router is `mlp.router` [E, H] with a bias.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from tandem.nodes.model.index import TensorEntry
    from tandem.nodes.model.spec import ModelSpec

Layout = Literal["stacked", "fused"]
_HF_SUFFIXES = {"_blocks": ".weight", "_scales": ".scales", "_bias": ".bias"}


def hf_entry(short: str, entry: TensorEntry) -> tuple[str, TensorEntry]:
    """A layer tensor's short name and entry as read (OpenAI's expert tensors renamed, the
    blocks read as words); any other as it is."""
    if not short.startswith("mlp.experts."):
        return short, entry
    for suffix, to in _HF_SUFFIXES.items():
        if short.endswith(suffix):
            short = short.removesuffix(suffix) + to
            if suffix == "_blocks" and entry.dtype == "U8" and len(entry.shape) == 4:
                *rows, groups, width = entry.shape  # 16 bytes: a group of 32 values
                words = (*rows, groups * width // 4)
                entry = dataclasses.replace(entry, dtype="U32", shape=words)
            return short, entry
    return short, entry


def layout(tensors: dict[str, object]) -> Layout:
    return "fused" if "mlp.experts.gate_up_proj.weight" in tensors else "stacked"


def layer_shapes(spec: ModelSpec, lay: Layout) -> dict[str, tuple[int, ...]]:
    """The logical (float) shapes a gpt-oss layer holds."""
    assert spec.moe is not None
    h, d, nq, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    e, inter = spec.moe.num_experts, spec.moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq * d, h),
        "self_attn.q_proj.bias": (nq * d,),
        "self_attn.k_proj.weight": (nkv * d, h),
        "self_attn.k_proj.bias": (nkv * d,),
        "self_attn.v_proj.weight": (nkv * d, h),
        "self_attn.v_proj.bias": (nkv * d,),
        "self_attn.o_proj.weight": (h, nq * d),
        "self_attn.o_proj.bias": (h,),
        "self_attn.sinks": (nq,),
        "mlp.router.weight": (e, h),
        "mlp.router.bias": (e,),
        "mlp.experts.down_proj.weight": (e, h, inter),
        "mlp.experts.down_proj.bias": (e, h),
    }
    if lay == "fused":
        shapes["mlp.experts.gate_up_proj.weight"] = (e, 2 * inter, h)
        shapes["mlp.experts.gate_up_proj.bias"] = (e, 2 * inter)
    else:
        for proj in ("gate_proj", "up_proj"):
            shapes[f"mlp.experts.{proj}.weight"] = (e, inter, h)
            shapes[f"mlp.experts.{proj}.bias"] = (e, inter)
    return shapes
