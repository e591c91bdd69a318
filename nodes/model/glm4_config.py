"""GLM-4.x MoE's config keys (`model_type: glm4_moe`: GLM-4.5, 4.5-Air, 4.6, 4.7), read as
mlx-lm's `glm4_moe.py` reads them.

- Attention: GQA with `head_dim` from the config, q/k/v biases where `attention_bias`, per-head
  q/k RMSNorm where `use_qk_norm`, RoPE (not traditional) on the first
  int(head_dim · `partial_rotary_factor`) dims of each head, base `rope_theta`. mlx-lm's
  `nn.RoPE` takes no scaling: the spec's `rope_scaling` is None whatever the config says.
- The MLP: the DeepSeek-V3 lineage's (`noaux_moe_config.py`), every layer from
  `first_k_dense_replace` on routed.
- mlx-lm's model always has its own `lm_head`: a tied config is refused.
- Every key mlx-lm's `ModelArgs` needs (no default there) must be present: mlx-lm would not
  load the model otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.noaux_moe_config import read_noaux_moe

# mlx-lm's glm4_moe `ModelArgs` fields without a default
REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings",
    "moe_intermediate_size", "norm_topk_prob", "num_attention_heads", "n_group", "head_dim",
    "topk_group", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
    "num_experts_per_tok", "first_k_dense_replace", "num_hidden_layers", "num_key_value_heads",
    "rms_norm_eps", "rope_theta", "rope_scaling", "use_qk_norm", "tie_word_embeddings",
    "attention_bias", "partial_rotary_factor",
)  # fmt: skip


def glm4_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ModelSpec fields a GLM-4.x MoE config sets otherwise than the dense families'."""
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ModelError(f"{where}: missing key {missing[0]!r} (mlx-lm's glm4_moe needs it)")
    if config["tie_word_embeddings"]:
        raise ModelError(f"{where}: tie_word_embeddings: mlx-lm's glm4_moe has its own lm_head")
    try:
        layers = int(config["num_hidden_layers"])
        head_dim = int(config["head_dim"])
        factor = float(config["partial_rotary_factor"])
        theta = float(config["rope_theta"])
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: malformed value ({e})") from None
    rotary = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or rotary < 2 or rotary % 2:
        raise ModelError(
            f"{where}: partial_rotary_factor {factor} of head_dim {head_dim} turns {rotary} "
            "dims (an even number, at least 2)"
        )
    return {
        "moe": read_noaux_moe(config, layers, where, layer_freq=False),
        "head_dim": head_dim,
        "partial_rotary_factor": factor,
        "rope_theta": theta,
        "rope_scaling": None,
        "qk_norm": bool(config["use_qk_norm"]),
        "tie_word_embeddings": False,
    }
