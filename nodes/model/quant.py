"""MLX quantization as a checkpoint's `config.json` describes it (mlx-lm 0.32).

`quantization` (or `quantization_config`) holds the default `group_size`, `bits` and `mode`,
plus per-module overrides keyed by module path ("model.layers.3.mlp.down_proj"): a dict
(whose `group_size` may be null: the mode's default), or `false` for a module left in float.
A quantized module stores `weight` (uint32 words, values packed from the low bits up and
crossing word boundaries for 3, 5 and 6 bits), `scales` and `biases` (one per group of input
columns), with `w = scales * q + biases` ("affine"). Other modes (mxfp4, mxfp8, nvfp4) store
uint8 scales and no biases; tandem refuses them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.nodes.model.errors import ModelError

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = {"affine": 64, "mxfp4": 32, "mxfp8": 32, "nvfp4": 16}


@dataclass(frozen=True)
class Quant:
    """How one module's weight is stored: `bits` per value, `group_size` values per scale."""

    bits: int
    group_size: int
    mode: str = "affine"

    def packed_cols(self, cols: int) -> int:
        """uint32 words per row for `cols` values."""
        return cols * self.bits // 32

    def groups(self, cols: int) -> int:
        return cols // self.group_size


@dataclass(frozen=True)
class QuantConfig:
    """The default and the per-module overrides; `None` from `of()` means float."""

    default: Quant | None
    overrides: dict[str, Quant | None]

    def of(self, module: str) -> Quant | None:
        return self.overrides.get(module, self.default)

    @property
    def quantized(self) -> bool:
        return self.default is not None or any(q is not None for q in self.overrides.values())


def _quant(raw: dict[str, Any], default_mode: str, module: str, where: str) -> Quant:
    mode = str(raw.get("mode") or default_mode)
    if mode != "affine":
        raise ModelError(
            f"{where}: quantization mode {mode!r} (used by {module}) is not supported yet; "
            "tandem reads affine MLX checkpoints"
        )
    try:
        bits = int(raw["bits"])
        group = raw.get("group_size")
        group = DEFAULT_GROUP[mode] if group is None else int(group)
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{where}: malformed quantization for {module}: {raw!r}") from None
    if bits not in AFFINE_BITS or group not in GROUP_SIZES:
        raise ModelError(
            f"{where}: {module} has {bits}-bit groups of {group}; tandem reads bits "
            f"{', '.join(map(str, AFFINE_BITS))} with groups of {', '.join(map(str, GROUP_SIZES))}"
        )
    return Quant(bits, group, mode)


def parse_quantization(config: dict[str, Any], where: str) -> QuantConfig:
    """The checkpoint's quantization; an empty one (all float) when it has none."""
    raw = config.get("quantization", config.get("quantization_config"))
    if raw is None:
        return QuantConfig(None, {})
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: quantization must be an object, not {raw!r}")
    if "quant_method" in raw and "bits" not in raw:  # a transformers config (GPTQ, AWQ, ...)
        raise ModelError(f"{where}: {raw['quant_method']!r} quantization is not supported")
    mode = str(raw.get("mode") or "affine")
    default = _quant(raw, mode, "every module", where) if "bits" in raw else None
    overrides: dict[str, Quant | None] = {}
    for key, value in raw.items():
        if value is False:
            overrides[key] = None
        elif isinstance(value, dict):
            overrides[key] = _quant({"mode": mode, **value}, mode, key, where)
    return QuantConfig(default, overrides)
