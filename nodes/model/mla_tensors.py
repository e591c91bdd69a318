"""Multi-head latent attention's tensors (DeepSeek V3, Kimi K2), in either layout.

- DeepSeek's (Hugging Face): the latent's up-projection whole, `self_attn.kv_b_proj`
  [heads · (nope + v), kv_lora]: each head's nope rows (its keys), then its v rows;
- mlx-lm's saved form: split per head (its `sanitize`), `self_attn.embed_q` [heads, kv_lora,
  nope] (the keys' projection, transposed) and `self_attn.unembed_out` [heads, v, kv_lora].

Both hold q (`q_a_proj`, `q_a_layernorm`, `q_b_proj`, or `q_proj` without a q rank), the
latent and rope key's down-projection `kv_a_proj_with_mqa` [kv_lora + rope, H], its norm
`kv_a_layernorm`, and `o_proj` [H, heads · v] (biases on q_a, kv_a and o where
`attention_bias`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.nodes.model.spec import ModelSpec

HF_UP = "self_attn.kv_b_proj.weight"  # present: DeepSeek's layout


def attention_shapes(spec: ModelSpec, hf: bool) -> dict[str, tuple[int, ...]]:
    """The logical (float) shapes of a latent layer's attention tensors."""
    mla = spec.mla
    assert mla is not None
    h, nh, bias = spec.hidden_size, spec.num_heads, spec.attention_bias
    shapes: dict[str, tuple[int, ...]] = {}
    if mla.q_lora_rank:
        shapes["self_attn.q_a_proj.weight"] = (mla.q_lora_rank, h)
        shapes["self_attn.q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes["self_attn.q_b_proj.weight"] = (nh * mla.q_dim, mla.q_lora_rank)
        if bias:
            shapes["self_attn.q_a_proj.bias"] = (mla.q_lora_rank,)
    else:
        shapes["self_attn.q_proj.weight"] = (nh * mla.q_dim, h)
    shapes["self_attn.kv_a_proj_with_mqa.weight"] = (mla.kv_lora_rank + mla.rope_dim, h)
    shapes["self_attn.kv_a_layernorm.weight"] = (mla.kv_lora_rank,)
    if hf:
        shapes[HF_UP] = (nh * (mla.nope_dim + mla.v_dim), mla.kv_lora_rank)
    else:
        shapes["self_attn.embed_q.weight"] = (nh, mla.kv_lora_rank, mla.nope_dim)
        shapes["self_attn.unembed_out.weight"] = (nh, mla.v_dim, mla.kv_lora_rank)
    shapes["self_attn.o_proj.weight"] = (h, nh * mla.v_dim)
    if bias:
        shapes["self_attn.kv_a_proj_with_mqa.bias"] = (mla.kv_lora_rank + mla.rope_dim,)
        shapes["self_attn.o_proj.bias"] = (h,)
    return shapes
