"""MLX quantization as a checkpoint's `config.json` describes it (mlx-lm 0.32).

`quantization` (or `quantization_config`) holds the default `group_size`, `bits` and `mode`,
plus per-module overrides keyed by module path ("model.layers.3.mlp.down_proj"): a dict, or
`false` for a module left in float. An override is what mlx-lm hands `to_quantized`: its
missing `mode` is "affine" (not the default's), a missing or null `group_size` or `bits` the
mode's default; so mlx-lm's Qwen3-MoE router at `{"group_size": 64, "bits": 8}` stays affine
in an mxfp4 model, and a mixed recipe may give its experts mxfp4 and the rest affine.

A quantized module stores `weight`: uint32 words, values packed from the low bits up (3-, 5-
and 6-bit values cross word boundaries), and `scales`, one per `group_size` input columns:
- "affine" (2-8 bits, groups of 32/64/128): float scales and `biases`, `w = scales * q + biases`;
- "mxfp4" (4 bits, groups of 32): FP4 e2m1 values, uint8 e8m0 scales (2^(s-127)), no biases;
- "mxfp8" (8 bits, groups of 32): FP8 e4m3 values, e8m0 scales, no biases;
- "nvfp4" (4 bits, groups of 16): e2m1 values, uint8 FP8 e4m3 scales, no biases.

A Hugging Face `"quantization_config": {"quant_method": "mxfp4"|"mxfp8", ...}` (OpenAI's
gpt-oss) is that mode for every module but its `modules_to_not_convert` (as mlx-lm reads it,
which quantizes exactly the modules stored with `.scales`).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tandem.nodes.model.errors import ModelError

Mode = Literal["affine", "mxfp4", "mxfp8", "nvfp4"]
MODES: tuple[Mode, ...] = get_args(Mode)
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
FP_MODES: dict[str, tuple[int, int]] = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
DEFAULTS: dict[str, tuple[int, int]] = {"affine": (4, 64), **FP_MODES}  # (bits, group_size)
DEFAULT_GROUP = {mode: group for mode, (_, group) in DEFAULTS.items()}
HF_METHODS: dict[str, Mode] = {"mxfp4": "mxfp4", "mxfp8": "mxfp8"}  # as mlx-lm maps them


@dataclass(frozen=True)
class Quant:
    """How one module's weight is stored: `bits` per value, `group_size` values per scale."""

    bits: int
    group_size: int
    mode: Mode = "affine"

    @property
    def biases(self) -> bool:
        """Whether the module stores `biases` (affine); the fp modes store scales only."""
        return self.mode == "affine"

    def packed_cols(self, cols: int) -> int:
        """uint32 words per row for `cols` values."""
        return cols * self.bits // 32

    def groups(self, cols: int) -> int:
        return cols // self.group_size


@dataclass(frozen=True)
class QuantConfig:
    """The default and the per-module overrides; `None` from `of()` means float. `floats`:
    Hugging Face's `modules_to_not_convert`, patterns (`*` any run of characters) matching a
    module's path, a dotted prefix of it, or a dotted suffix."""

    default: Quant | None
    overrides: dict[str, Quant | None]
    floats: tuple[str, ...] = field(default=())

    def of(self, module: str) -> Quant | None:
        if module in self.overrides:
            return self.overrides[module]
        if any(_matches(module, pattern) for pattern in self.floats):
            return None
        return self.default

    @property
    def quantized(self) -> bool:
        return self.default is not None or any(q is not None for q in self.overrides.values())


@functools.lru_cache(maxsize=1 << 16)  # a plan asks for every module again and again
def _matches(module: str, pattern: str) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in (pattern, f"{pattern}.*", f"*.{pattern}"))


def _quant(raw: dict[str, Any], module: str, where: str) -> Quant:
    mode = raw.get("mode") or "affine"
    if mode not in MODES:
        raise ModelError(
            f"{where}: quantization mode {mode!r} (used by {module}) is not supported; tandem "
            f"reads {', '.join(MODES)}"
        )
    try:
        bits, group = raw.get("bits"), raw.get("group_size")
        bits = DEFAULTS[mode][0] if bits is None else int(bits)
        group = DEFAULTS[mode][1] if group is None else int(group)
    except (TypeError, ValueError):
        raise ModelError(f"{where}: malformed quantization for {module}: {raw!r}") from None
    if mode in FP_MODES and (bits, group) != FP_MODES[mode]:
        want_bits, want_group = FP_MODES[mode]
        raise ModelError(
            f"{where}: {module} is {mode} with {bits}-bit groups of {group}; {mode} stores "
            f"{want_bits}-bit values in groups of {want_group}"
        )
    if mode == "affine" and (bits not in AFFINE_BITS or group not in GROUP_SIZES):
        raise ModelError(
            f"{where}: {module} has {bits}-bit groups of {group}; tandem reads bits "
            f"{', '.join(map(str, AFFINE_BITS))} with groups of {', '.join(map(str, GROUP_SIZES))}"
        )
    return Quant(bits, group, mode)


def _hugging_face(raw: dict[str, Any], where: str) -> QuantConfig:
    """A transformers `quantization_config` without MLX's `bits`: mxfp4/mxfp8 (gpt-oss)."""
    method = raw["quant_method"]
    if method not in HF_METHODS:
        raise ModelError(f"{where}: {method!r} quantization is not supported")
    floats = raw.get("modules_to_not_convert") or []
    if not isinstance(floats, list) or not all(isinstance(m, str) for m in floats):
        raise ModelError(f"{where}: modules_to_not_convert must be a list of module names")
    mode = HF_METHODS[method]
    return QuantConfig(Quant(*FP_MODES[mode], mode), {}, tuple(floats))


def parse_quantization(config: dict[str, Any], where: str) -> QuantConfig:
    """The checkpoint's quantization; an empty one (all float) when it has none."""
    raw = config.get("quantization", config.get("quantization_config"))
    if raw is None:
        return QuantConfig(None, {})
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: quantization must be an object, not {raw!r}")
    if "quant_method" in raw and "bits" not in raw:  # a transformers config (GPTQ, AWQ, ...)
        return _hugging_face(raw, where)
    default = _quant(raw, "every module", where) if "bits" in raw else None
    overrides: dict[str, Quant | None] = {}
    for key, value in raw.items():
        if value is False:
            overrides[key] = None
        elif isinstance(value, dict):
            overrides[key] = _quant(value, key, where)
    return QuantConfig(default, overrides)
