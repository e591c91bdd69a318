"""MLX affine quantization in torch, bit for bit as `mx.quantize` computes it, for the KV
cache the prefill node sends quantized.

mlx's rule per group of `group_size` values, all in float32 (the inputs widened exactly):
`scale = max((max - min) / n_bins, 1e-7)` with `n_bins = 2**bits - 1`; the edge is the
extreme of larger magnitude (`min` when `|min| > |max|`, else `max`; `scale` is negated when
the edge is `max`), `q0 = round(edge / scale)`, and unless `q0` is zero the scale becomes
`edge / q0` and the bias `edge` (so the edge is exact); if `q0` is zero the bias is 0 and the
scale stays. Each value is `clip(round((w - bias) / scale), 0, n_bins)`, from the float32
scale and bias; only the stored scales and biases are rounded to the input's dtype. Values
pack from the low bits up into little-endian uint32 words along the last axis.

mlx's kernels differ in two details, so `kernel` picks which one to match: its CPU kernel
(and its op-by-op fallback) takes the group's true max and rounds halves to even
(std::rint); its Metal and CUDA kernels start the max at 0 (a group whose values are all
negative gets `max = 0`) and round halves away from zero (`round`). The tests check "cpu"
against mlx itself; "gpu" only against those two rules, for want of a Metal device.

Plain torch ops, the same on CPU and CUDA, vectorized over all groups: the values widened
once, a min and a max reduction, a few ops on the [N, groups, 1] scales, then four
elementwise passes over the values in place and one to pack them. Divisions are always
tensor by tensor: CUDA turns a division by a Python (CPU) scalar into a multiplication by
its reciprocal, which rounds differently.
"""

from __future__ import annotations

from typing import Literal

import torch

KV_BITS = (2, 4, 8)  # bit widths that pack whole values into bytes
GROUP_SIZES = (32, 64, 128)
EPS = 1e-7  # mlx's floor on the magnitude of a scale (compared as a float32)

Kernel = Literal["cpu", "gpu"]


def _round(v: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """Nearest integer: halves to even (std::rint, mlx CPU) or away from zero (Metal/CUDA)."""
    if kernel == "cpu":
        return v.round_()
    t = v.trunc()  # v - trunc(v) is exact, so the halves are found exactly
    return t.add_(torch.where((v - t).abs_() >= 0.5, v.sign(), 0.0))


def quantize(
    x: torch.Tensor, group_size: int, bits: int, *, kernel: Kernel = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mx.quantize(x, group_size, bits)` (affine) of x [..., D] (float32, float16 or
    bfloat16, D a multiple of group_size): packed words [..., D·bits/32] uint32, scales and
    biases [..., D/group_size] in x's dtype. For finite inputs."""
    if bits not in KV_BITS or group_size not in GROUP_SIZES:
        raise ValueError(
            f"{bits}-bit groups of {group_size}: supported bits {KV_BITS}, group sizes "
            f"{GROUP_SIZES}"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"cannot quantize {x.dtype}; float32, float16 or bfloat16 only")
    *lead, d = x.shape
    if d % group_size:
        raise ValueError(f"last axis {d} is not a multiple of the group size {group_size}")
    groups = d // group_size
    # [N, G, gs] float32, widened exactly, a copy of its own (the values are worked in place)
    g = x.reshape(-1, groups, group_size).to(torch.float32, copy=True)

    # [N, G, 1]; amin and amax apart: aminmax over a short last axis is several times slower
    w_min, w_max = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    if kernel == "gpu":
        w_max = w_max.clamp_min_(0.0)
    n_bins = torch.full_like(w_max, (1 << bits) - 1)  # a tensor divisor, not a scalar
    mask = w_min.abs() > w_max.abs()
    scale = ((w_max - w_min) / n_bins).clamp_min_(EPS)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = _round(edge / scale, kernel)
    at_zero = q0 == 0
    scale = torch.where(at_zero, scale, edge / q0)
    bias = torch.where(at_zero, 0.0, edge)
    # A constant group past ~3e31 overflows q0 and leaves scale ±0: its values are 0, as
    # mlx's CPU kernel casts the NaN of 0/0; divide by 1 there instead.
    divisor = torch.where(scale == 0, 1.0, scale)

    v = g.sub_(bias).div_(divisor)  # [N, G, gs] float32
    q = _round(v, kernel).clamp_(0, (1 << bits) - 1).to(torch.uint8)

    per_byte = 8 // bits
    q = q.view(-1, groups, group_size // per_byte, per_byte)
    packed = q[..., 0]
    for k in range(1, per_byte):  # value k of a byte sits at bit k·bits
        packed = packed | (q[..., k] << (k * bits))
    # bytes in order make little-endian words: value i of a word at bit i·bits
    words = packed.reshape(*lead, d * bits // 8).view(torch.uint32)
    scales = scale.to(x.dtype).reshape(*lead, groups)
    biases = bias.to(x.dtype).reshape(*lead, groups)
    return words, scales, biases
