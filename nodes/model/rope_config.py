"""RoPE keys of a config: the base (`rope_theta`, at the top level or inside `rope_parameters`:
a DESIGN.md trap) and the scaling (`rope_scaling`, or `rope_parameters` in transformers 5), as
mlx-lm's `initialize_rope` reads them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tandem.nodes.model.errors import ModelError


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3`), linear position scaling, or
    YaRN (`yarn`: gpt-oss, DeepSeek V3; mlx-lm's `YarnRoPE`, which also scales q and k by
    its mscale)."""

    kind: Literal["llama3", "linear", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the correction range's ends, in rotations
    beta_slow: float = 1.0
    mscale: float = 1.0  # yarn: the attention scale's factors
    mscale_all_dim: float = 0.0


def rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    if "rope_theta" in config:
        return float(config["rope_theta"])
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0


def rope_scaling(config: dict[str, Any], where: Path) -> RopeScaling | None:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    try:
        factor = float(scaling["factor"])
        if kind == "llama3":
            return RopeScaling(
                kind="llama3",
                factor=factor,
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    scaling.get("original_max_position_embeddings", 8192)
                ),
            )
        if kind == "linear":
            return RopeScaling(kind="linear", factor=factor)
        if kind in ("yarn", "deepseek_yarn"):  # mlx-lm reads five keys, else its defaults
            return RopeScaling(
                kind="yarn",
                factor=factor,
                original_max_position_embeddings=int(
                    scaling.get("original_max_position_embeddings", 4096)
                ),
                beta_fast=float(scaling.get("beta_fast", 32.0)),
                beta_slow=float(scaling.get("beta_slow", 1.0)),
                mscale=float(scaling.get("mscale", 1.0)),
                mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
            )
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{where}: malformed rope scaling {scaling!r}") from None
    raise ModelError(f"{where}: unsupported rope scaling type {kind!r}")
