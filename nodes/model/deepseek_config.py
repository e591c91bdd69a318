"""DeepSeek V3's config keys (`model_type: deepseek_v3`, Kimi K2's `kimi_k2`), read as mlx-lm's
`deepseek_v3.py` reads them.

- Multi-head latent attention (`MlaSpec`): q through a low-rank `q_a_proj` (normed, then
  `q_b_proj`), or `q_proj` where `q_lora_rank` is null; per head a `qk_nope_head_dim` part and
  a `qk_rope_head_dim` part; K and V from one latent of `kv_lora_rank` (`kv_a_proj_with_mqa`,
  normed) plus one roped key shared by every head. What a layer keeps per position is the
  latent and the roped key (mlx-lm's `KVCache`: keys [1, 1, T, kv_lora], values [1, 1, T,
  rope]): the layer kind "latent".
- RoPE turns pairs of adjacent dims (`traditional`), with YaRN (`rope_scaling` of type yarn or
  deepseek_yarn); mlx-lm also scales the attention by (0.1 · mscale_all_dim · ln(factor) + 1)².
- The MLP: the lineage's router and shared experts (`noaux_moe_config.py`), dense before
  `first_k_dense_replace` and where i % `moe_layer_freq` != 0.

A leaf module: `spec.py` builds the `ModelSpec` from what it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.nodes.model.errors import ModelError


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention's widths."""

    q_lora_rank: int  # 0: q_proj whole
    kv_lora_rank: int  # the latent's width: what the cache keeps per position, with the rope key
    rope_dim: int  # qk_rope_head_dim: the shared roped key's width
    nope_dim: int  # qk_nope_head_dim
    v_dim: int  # v_head_dim

    @property
    def q_dim(self) -> int:
        """A query head's (and a decompressed key's) width."""
        return self.nope_dim + self.rope_dim

    def attention_scale(self, scaling: dict[str, Any] | None) -> float:
        """mlx-lm's: q_dim^-1/2, times YaRN's mscale_all_dim factor squared."""
        scale = self.q_dim**-0.5
        scaling = scaling or {}
        m, factor = float(scaling.get("mscale_all_dim") or 0), float(scaling.get("factor") or 1)
        if m and factor > 1:
            s = 0.1 * m * math.log(factor) + 1.0
            scale *= s * s
        return scale


def read_mla(config: dict[str, Any], where: Path) -> MlaSpec:
    try:
        q_lora = config.get("q_lora_rank")
        mla = MlaSpec(
            int(q_lora or 0),
            int(config.get("kv_lora_rank") or 512),
            int(config.get("qk_rope_head_dim") or 64),
            int(config.get("qk_nope_head_dim") or 128),
            int(config.get("v_head_dim") or 128),
        )
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: malformed latent attention widths ({e})") from None
    if min(mla.kv_lora_rank, mla.rope_dim, mla.nope_dim, mla.v_dim) < 1 or mla.rope_dim % 2:
        raise ModelError(f"{where}: latent attention widths must be positive, the rope's even")
    return mla


def deepseek_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ModelSpec fields a DeepSeek V3 config sets otherwise than the dense families'."""
    from tandem.nodes.model.noaux_moe_config import read_noaux_moe
    from tandem.nodes.model.spec import LayerKind

    mla = read_mla(config, where)
    layers = int(config["num_hidden_layers"])
    return {
        "layer_kinds": (LayerKind("latent"),) * layers,
        "mla": mla,
        "num_kv_heads": 1,  # one latent and one rope key a position, whatever the heads
        "head_dim": mla.q_dim,
        "query_pre_attn_scalar": mla.attention_scale(config.get("rope_scaling")) ** -2,
        "moe": read_noaux_moe(config, layers, where, layer_freq=True),
        "attention_bias": bool(config.get("attention_bias", False)),
        "max_position_embeddings": int(config.get("max_position_embeddings") or 163840),
    }
