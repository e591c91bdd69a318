"""Gemma 3's config keys (`model_type: gemma3_text`), read as mlx-lm's `gemma3_text` reads them.

mlx-lm is the decode side, so where a key is missing it is read with mlx-lm's defaults (head
256, one KV head, window 512, every 6th layer global, RoPE 1e6 global / 1e4 local), and a
config mlx-lm would read otherwise than it says is refused:

- mlx-lm derives each layer's kind from `sliding_window_pattern` alone (layer i is global
  when (i + 1) % pattern == 0); `layer_types` (transformers 4.53+) must agree with it.
- RoPE thetas stand at the top level (`rope_theta`, `rope_local_base_freq`) or per layer type
  in `rope_parameters` (transformers 5, which writes `rope_theta: null` at the top level).
  mlx-lm reads the top level only and uses its defaults for what is missing or null, which
  are what transformers 5 writes per type for the released models; a per-type theta that
  differs from what mlx-lm would use is refused.
- mlx-lm scales the global layers' RoPE by the top-level `rope_scaling` only.

A leaf module: `spec.py` builds the `ModelSpec` from what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.nodes.model.errors import ModelError

GLOBAL_THETA = 1_000_000.0  # mlx-lm's `rope_theta` default
LOCAL_THETA = 10_000.0  # mlx-lm's `rope_local_base_freq` default
WINDOW = 512  # mlx-lm's `sliding_window` default
PATTERN = 6  # mlx-lm's `sliding_window_pattern` default
HEAD_DIM = 256  # mlx-lm's `head_dim` and `query_pre_attn_scalar` default
_TYPES = {"sliding_attention": True, "full_attention": False}  # layer_types → sliding


@dataclass(frozen=True)
class Gemma3Keys:
    """What a Gemma 3 config says beyond the dense keys."""

    sliding: tuple[bool, ...]  # per layer: a sliding-window layer (else global)
    window: int  # positions a sliding layer attends to (its own included)
    rope_theta: float  # global layers
    rope_local_theta: float  # sliding layers
    head_dim: int
    num_kv_heads: int
    query_pre_attn_scalar: float  # attention scale: its -1/2 power
    hidden_act: str


def _theta(config: dict[str, Any], key: str, kind: str, default: float, where: Path) -> float:
    """A theta as mlx-lm reads it (top-level `key`, else `default`), checked against the
    per-type `rope_parameters[kind]` where that is given."""
    top = config.get(key)
    theta = float(top) if top is not None else default
    per_type = (config.get("rope_parameters") or {}).get(kind) or {}
    given = per_type.get("rope_theta")
    if given is not None and float(given) != theta:
        raise ModelError(
            f"{where}: rope_parameters.{kind}.rope_theta is {given} but mlx-lm reads {theta} "
            f"(top-level {key!r}); write it at the top level"
        )
    return theta


def _sliding(config: dict[str, Any], layers: int, where: Path) -> tuple[bool, ...]:
    pattern = int(config.get("sliding_window_pattern") or PATTERN)
    if pattern < 1:
        raise ModelError(f"{where}: sliding_window_pattern must be positive")
    sliding = tuple((i + 1) % pattern != 0 for i in range(layers))
    types = config.get("layer_types")
    if types is not None:
        try:
            given = tuple(_TYPES[t] for t in types)
        except (KeyError, TypeError):
            raise ModelError(f"{where}: malformed layer_types {types!r}") from None
        if given != sliding:
            raise ModelError(
                f"{where}: layer_types disagree with sliding_window_pattern={pattern}, "
                "which is all mlx-lm reads"
            )
    return sliding


def read_gemma3(config: dict[str, Any], where: Path) -> Gemma3Keys:
    """The Gemma 3 keys of `config` (a ModelError for malformed or disagreeing ones)."""
    try:
        layers = int(config["num_hidden_layers"])
        window = int(config.get("sliding_window") or WINDOW)
        if window < 1:
            raise ModelError(f"{where}: sliding_window must be positive")
        return Gemma3Keys(
            sliding=_sliding(config, layers, where),
            window=window,
            rope_theta=_theta(config, "rope_theta", "full_attention", GLOBAL_THETA, where),
            rope_local_theta=_theta(
                config, "rope_local_base_freq", "sliding_attention", LOCAL_THETA, where
            ),
            head_dim=int(config.get("head_dim") or HEAD_DIM),
            num_kv_heads=int(config.get("num_key_value_heads") or 1),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or HEAD_DIM),
            hidden_act=str(
                config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
            ),
        )
    except KeyError as e:
        raise ModelError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: malformed value ({e})") from None
