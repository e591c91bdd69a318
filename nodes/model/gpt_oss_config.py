"""gpt-oss's config keys (`model_type: gpt_oss`), read as mlx-lm's `gpt_oss.py` reads them.

- `layer_types`: "sliding_attention" (a window of `sliding_window`, 128 in the released
  models) or "full_attention"; mlx-lm's default where absent: the two alternating, sliding
  first.
- Every layer routes: `num_local_experts` experts (`experts_per_token` in OpenAI's own key),
  top-`num_experts_per_tok`, each `intermediate_size` wide. The router has a bias, and the
  chosen experts' logits are softmaxed among themselves (the family's own rule).
- Attention has biases on q/k/v and o, a learned sink per query head, head_dim 64.
- mlx-lm reads neither `swiglu_limit` nor an alpha: the experts' gate is clamped at 7.0,
  with alpha 1.702 (`SwigluOAI`); a config that says otherwise is refused.

A leaf module: `spec.py` builds the `ModelSpec` from what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.nodes.model.errors import ModelError

SWIGLU_LIMIT = 7.0  # mlx-lm's `SwigluOAI` defaults, which its gpt_oss.py always uses
SWIGLU_ALPHA = 1.702
WINDOW = 128  # mlx-lm's `sliding_window` default
_TYPES = {"sliding_attention": True, "full_attention": False}


@dataclass(frozen=True)
class GptOssKeys:
    """What a gpt-oss config says beyond the dense keys."""

    sliding: tuple[bool, ...]  # per layer: a sliding-window layer (else full attention)
    window: int
    experts: int
    top_k: int
    expert_width: int  # each expert's intermediate size


def read_gpt_oss(config: dict[str, Any], where: Path) -> GptOssKeys:
    try:
        layers = int(config["num_hidden_layers"])
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 128)
        top_k = int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 4)
        width = int(config["intermediate_size"])
        window = int(config.get("sliding_window") or WINDOW)
    except KeyError as e:
        raise ModelError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: malformed value ({e})") from None
    if not 1 <= top_k <= experts or window < 1:
        raise ModelError(f"{where}: top-{top_k} of {experts} experts, window {window}")
    limit = float(config.get("swiglu_limit") or SWIGLU_LIMIT)
    if limit != SWIGLU_LIMIT:
        raise ModelError(
            f"{where}: swiglu_limit {limit}, but mlx-lm's gpt_oss clamps at {SWIGLU_LIMIT}"
        )
    types = config.get("layer_types") or ["sliding_attention", "full_attention"] * (layers // 2)
    try:
        sliding = tuple(_TYPES[t] for t in types)
    except (KeyError, TypeError):
        raise ModelError(f"{where}: malformed layer_types {types!r}") from None
    if len(sliding) != layers or all(sliding) or not any(sliding):
        # mlx-lm looks up one layer of each type for its masks
        raise ModelError(
            f"{where}: layer_types must give each of the {layers} layers a type, with at "
            "least one sliding and one full attention layer (as mlx-lm's gpt_oss needs)"
        )
    return GptOssKeys(sliding, window, experts, top_k, width)
