"""Math every family shares: rotary position embeddings and RMSNorm, as mlx-lm computes them.

Shapes: T = tokens, D = head_dim.
"""

from __future__ import annotations

import math

import torch
from tandem.nodes.model.spec import ModelSpec, RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., N]; normalise in float32, then scale in the model dtype (as HF and mlx do)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Per-pair rotation frequencies [D/2] (float32), with Llama 3 or linear scaling."""
    d = spec.head_dim
    periods = spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    scaling = spec.rope_scaling
    if scaling is not None and scaling.kind == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelens = 2 * math.pi * periods
        scaled = torch.where(wavelens > low_wavelen, periods * scaling.factor, periods)
        medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
        smooth = (old / wavelens - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smooth_periods = scaled / ((1 - smooth) / scaling.factor + smooth)
        periods = torch.where(medium, smooth_periods, scaled)
    if scaling is not None and scaling.kind == "yarn":
        periods = _yarn_periods(periods, d, spec.rope_theta, scaling)
    freqs = 1.0 / periods
    if scaling is not None and scaling.kind == "linear":
        freqs = freqs / scaling.factor
    return freqs


def _yarn_periods(periods: torch.Tensor, d: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's periods [D/2] as mlx-lm's `YarnRoPE` makes them: the interpolated (× factor)
    and the original blended by a linear ramp over the pairs between the correction range's
    ends (the pairs that turn `beta_fast` and `beta_slow` times over the original context)."""
    old, factor = scaling.original_max_position_embeddings, scaling.factor

    def pair(rotations: float) -> float:
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair(scaling.beta_fast)), 0)
    high = min(math.ceil(pair(scaling.beta_slow)), d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the original period (fast pairs), 0: interpolated
    inter = factor * periods
    return inter * periods / (inter * keep + periods * (1 - keep))


def rope_mscale(spec: ModelSpec) -> float:
    """What YaRN scales q and k by before turning them (mlx-lm's `YarnRoPE.mscale`); 1.0
    for every other RoPE."""
    scaling = spec.rope_scaling
    if scaling is None or scaling.kind != "yarn":
        return 1.0

    def get(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return get(scaling.factor, scaling.mscale) / get(scaling.factor, scaling.mscale_all_dim)


def rope_tables(
    freqs: torch.Tensor, start: int, count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [count, D] for positions start..start+count-1 (float32)."""
    pos = torch.arange(start, start + count, dtype=torch.float32, device=device)
    angles = torch.outer(pos, freqs.to(device))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [h, T, D]; rotate_half form == mlx `traditional=False`
    rot = cos.shape[-1]
    if rot < x.shape[-1]:  # partial RoPE (GLM-4.x): the first `rot` dims turn, the rest pass
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
