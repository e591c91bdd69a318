"""Math every family shares: rotary position embeddings and RMSNorm, as mlx-lm computes them.

Shapes: T = tokens, D = head_dim.
"""

from __future__ import annotations

import math

import torch
from tandem.nodes.model.spec import ModelSpec


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
    freqs = 1.0 / periods
    if scaling is not None and scaling.kind == "linear":
        freqs = freqs / scaling.factor
    return freqs


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
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
