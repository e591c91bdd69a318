"""Qwen3.5's config keys and tensor names (`model_type: qwen3_5`, `qwen3_5_moe`), read as
mlx-lm 0.32's `qwen3_5.TextModelArgs` reads them.

- The text keys stand in `text_config` (Hugging Face's vision-language layout, which mlx-lm
  also saves) or at the top level (a flat config, which mlx-lm accepts too); the top-level
  ones are read where `text_config` lacks them (eos ids, dtype).
- mlx-lm takes `rope_theta` and `partial_rotary_factor` from `rope_parameters` only (defaults
  1e5 and 0.25), whatever the top level says.
- Layer i is linear attention (a gated delta net) unless (i + 1) is a multiple of
  `full_attention_interval`; with experts (`num_experts` > 0) every layer routes.
- Tensor names come in three layouts, mapped to the canonical `model.layers.N.*`,
  `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` (`canonical_name`).

A leaf module: `spec.py` builds the `ModelSpec` from what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.nodes.model.errors import ModelError

FAMILIES = ("qwen3_5", "qwen3_5_moe")
ROPE_THETA = 100_000.0  # mlx-lm's default
PARTIAL_ROTARY = 0.25  # mlx-lm's default
INTERVAL = 4  # mlx-lm's `full_attention_interval` default
# stored prefix -> canonical prefix, first match wins
_PREFIXES = (
    ("language_model.model.", "model."),  # mlx-lm's saved layout
    ("language_model.lm_head", "lm_head"),
    ("model.language_model.", "model."),  # Hugging Face's vision-language layout
)
_SKIPPED = ("model.visual.", "vision_tower.", "model.vision_tower.")


@dataclass(frozen=True)
class LinearSpec:
    """A gated delta net layer's shape (Qwen3.5's linear attention)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int  # the causal depthwise conv's width (positions)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, itemsize: int) -> int:
        """One sequence's state (bytes): the conv's last K-1 inputs in the model dtype
        (`itemsize` bytes each) and the float32 recurrent state [Hv, Dv, Dk]."""
        conv = (self.conv_kernel - 1) * self.conv_dim * itemsize
        return conv + self.num_v_heads * self.head_v_dim * self.head_k_dim * 4


@dataclass(frozen=True)
class Qwen35Keys:
    """What a Qwen3.5 config says beyond the dense keys."""

    text: dict[str, Any]  # the text keys, flattened (text_config over the top level)
    linear: LinearSpec
    linear_layers: tuple[bool, ...]  # per layer: linear attention (else full)
    rope_theta: float
    rope_parameters: dict[str, Any]  # with "rope_type" as mlx-lm's initialize_rope reads it
    partial_rotary_factor: float


def text_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: `text_config`'s over the top level's (a flat config as is)."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return dict(config)
    return {**config, **nested, "model_type": config.get("model_type")}


def read_qwen3_5(config: dict[str, Any], where: Path) -> Qwen35Keys:
    """The Qwen3.5 keys of `config` (a ModelError for malformed ones)."""
    text = text_keys(config)
    try:
        layers = int(text["num_hidden_layers"])
        interval = int(text.get("full_attention_interval") or INTERVAL)
        linear = LinearSpec(
            num_k_heads=int(text.get("linear_num_key_heads", 16)),
            num_v_heads=int(text.get("linear_num_value_heads", 64)),
            head_k_dim=int(text.get("linear_key_head_dim", 192)),
            head_v_dim=int(text.get("linear_value_head_dim", 128)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        )
        params = dict(text.get("rope_parameters") or {"rope_type": "default"})
        kind = params.get("type", params.get("rope_type", "default"))
        params["rope_type"] = kind
        keys = Qwen35Keys(
            text=text,
            linear=linear,
            linear_layers=tuple((i + 1) % interval != 0 for i in range(layers)),
            rope_theta=float(params.get("rope_theta", ROPE_THETA)),
            rope_parameters=params,
            partial_rotary_factor=float(params.get("partial_rotary_factor", PARTIAL_ROTARY)),
        )
    except KeyError as e:
        raise ModelError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: malformed value ({e})") from None
    if interval < 1 or min(linear.num_k_heads, linear.num_v_heads, linear.conv_kernel) < 1:
        raise ModelError(f"{where}: full_attention_interval and linear_* must be positive")
    if linear.num_v_heads % linear.num_k_heads:
        raise ModelError(
            f"{where}: linear_num_value_heads is not a multiple of linear_num_key_heads"
        )
    if not 0.0 < keys.partial_rotary_factor <= 1.0:
        raise ModelError(f"{where}: partial_rotary_factor must be in (0, 1]")
    return keys


def canonical_name(name: str) -> str | None:
    """The canonical name of stored tensor (or quantization path) `name`; None for what a
    text model skips (the vision tower, the multi-token-prediction head)."""
    if name.startswith(_SKIPPED) or "mtp." in name:
        return None
    for stored, canonical in _PREFIXES:
        if name.startswith(stored):
            return canonical + name[len(stored) :]
    return name


def linear_shapes(lin: LinearSpec, hidden: int, hf_conv: bool) -> dict[str, tuple[int, ...]]:
    """A linear-attention layer's tensors (short names) and shapes; the conv weight
    [C, K, 1] as mlx stores it, or [C, 1, K] as Hugging Face does (`hf_conv`)."""
    hv, k = lin.num_v_heads, lin.conv_kernel
    return {
        "linear_attn.in_proj_qkv.weight": (lin.conv_dim, hidden),
        "linear_attn.in_proj_z.weight": (lin.value_dim, hidden),
        "linear_attn.in_proj_b.weight": (hv, hidden),
        "linear_attn.in_proj_a.weight": (hv, hidden),
        "linear_attn.conv1d.weight": (lin.conv_dim, 1, k) if hf_conv else (lin.conv_dim, k, 1),
        "linear_attn.dt_bias": (hv,),
        "linear_attn.A_log": (hv,),
        "linear_attn.norm.weight": (lin.head_v_dim,),
        "linear_attn.out_proj.weight": (hidden, lin.value_dim),
    }
