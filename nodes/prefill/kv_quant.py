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
once (into a `Scratch` the caller keeps from layer to layer: on a CPU, first touches of a
fresh allocation's pages cost about as much as the quantizing), a min and a max reduction, a
few ops on the [N, groups, 1] scales (run once for a layer's K and V together: on a CPU they
cost about as much as the passes over the values), then four elementwise passes over the
values in place, one narrowing to bytes, and for 4 and 2 bits a shift-and-or over the bytes
to pack them. Divisions are always tensor by tensor: CUDA turns a division by a Python (CPU)
scalar into a multiplication by its reciprocal, which rounds differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

KV_BITS = (2, 4, 8)  # bit widths that pack whole values into bytes
GROUP_SIZES = (32, 64, 128)
EPS = 1e-7  # mlx's floor on the magnitude of a scale (compared as a float32)
MAGIC = float(1 << 23)  # 2**23: adding it to v in [0, 2**23) leaves round(v) in the low bits

Kernel = Literal["cpu", "gpu"]


def _round(v: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """Nearest integer: halves to even (std::rint, mlx CPU) or away from zero (Metal/CUDA)."""
    if kernel == "cpu":
        return v.round_()
    t = v.trunc()  # v - trunc(v) is exact, so the halves are found exactly
    return t.add_(torch.where((v - t).abs_() >= 0.5, v.sign(), 0.0))


Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # words, scales, biases


class Scratch:
    """Float32 working memory reused from call to call, grown to the largest asked for.
    Callers on one device stream only (a CUDA caller's next use is queued after this one)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """A float32 [numel] view of the working memory; the previous call's is overwritten."""
        if self._buf is None or self._buf.numel() < numel or self._buf.device != device:
            self._buf = None  # the old buffer goes before the new one is made
            self._buf = torch.empty(numel, dtype=torch.float32, device=device)
        return self._buf[:numel]


def quantize(x: torch.Tensor, group_size: int, bits: int, *, kernel: Kernel = "cpu") -> Quantized:
    """`mx.quantize(x, group_size, bits)` (affine) of x [..., D] (float32, float16 or
    bfloat16, D a multiple of group_size): packed words [..., D·bits/32] uint32, scales and
    biases [..., D/group_size] in x's dtype. For finite inputs."""
    return quantize_all((x,), group_size, bits, kernel=kernel)[0]


def quantize_all(
    xs: Sequence[torch.Tensor],
    group_size: int,
    bits: int,
    *,
    kernel: Kernel = "cpu",
    scratch: Scratch | None = None,
) -> list[Quantized]:
    """`quantize` of each x (of one dtype and device; a layer's K and V), the ~15 small ops on
    the groups' scales run once for all (each costs a kernel launch, or µs of dispatch).
    `scratch` holds the values widened to float32 (else a fresh allocation)."""
    _check(xs, group_size, bits)
    n_bins = (1 << bits) - 1
    work = (scratch or Scratch()).take(sum(x.numel() for x in xs), xs[0].device)
    # each [N, G, gs] float32, widened exactly into its own stretch of `work` (then worked in
    # place); the values' passes stay apart, each x's values fitting a core's cache where a
    # join would not
    gs, mins, maxes, at = [], [], [], 0
    for x in xs:
        g = work[at : at + x.numel()].view(-1, x.shape[-1] // group_size, group_size)
        gs.append(g.copy_(x.reshape(g.shape)))
        # amin and amax apart: aminmax over a short last axis is several times slower
        mins.append(g.amin(dim=-1, keepdim=True))
        maxes.append(g.amax(dim=-1, keepdim=True))
        at += x.numel()
    w_min, w_max = torch.cat(mins), torch.cat(maxes)  # [ΣN, G, 1]
    if kernel == "gpu":
        w_max = w_max.clamp_min_(0.0)
    low_edge = w_min.abs() > w_max.abs()
    edge = torch.where(low_edge, w_min, w_max)
    step = (w_max - w_min).div_(torch.full_like(w_max, n_bins)).clamp_min_(EPS)
    step = torch.where(low_edge, step, step.neg())  # divisors are tensors, never scalars
    q0 = _round(edge / step, kernel)
    at_zero = q0 == 0
    scale = torch.where(at_zero, step, edge / q0)
    bias = edge.masked_fill_(at_zero, 0.0)
    # A constant group past ~3e31 overflows q0 and leaves scale ±0: its values are 0, as
    # mlx's CPU kernel casts the NaN of 0/0; divide by 1 there instead.
    divisor = scale.masked_fill(scale == 0, 1.0)
    scales, biases = scale.to(xs[0].dtype), bias.to(xs[0].dtype)

    out, a = [], 0
    for x, g in zip(xs, gs, strict=True):
        b = a + g.shape[0]
        v = g.sub_(bias[a:b]).div_(divisor[a:b]).clamp_(0, n_bins)  # [N, G, gs] in [0, n_bins]
        if kernel == "cpu":
            # + 2**23 rounds half to even into the low mantissa bits: the value is the low byte
            q = v.add_(MAGIC).view(torch.int32).to(torch.uint8)
        else:
            q = _round(v, kernel).to(torch.uint8)
        *lead, d = x.shape
        words = _pack(q.view(-1), bits).view(*lead, d * bits // 32)
        out.append((words, scales[a:b].view(*lead, -1), biases[a:b].view(*lead, -1)))
        a = b
    return out


def _check(xs: Sequence[torch.Tensor], group_size: int, bits: int) -> None:
    if bits not in KV_BITS or group_size not in GROUP_SIZES:
        raise ValueError(
            f"{bits}-bit groups of {group_size}: supported bits {KV_BITS}, group sizes "
            f"{GROUP_SIZES}"
        )
    for x in xs:
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"cannot quantize {x.dtype}; float32, float16 or bfloat16 only")
        if (x.dtype, x.device, x.shape[-1]) != (xs[0].dtype, xs[0].device, xs[0].shape[-1]):
            raise ValueError("quantize_all takes tensors of one dtype, device and last axis")
        if x.shape[-1] % group_size:
            raise ValueError(
                f"last axis {x.shape[-1]} is not a multiple of the group size {group_size}"
            )


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Values q [M] uint8 (each < 2**bits) packed from the low bits up: value k of a byte at
    bit k·bits, bytes in order, so the little-endian words hold value i at bit i·bits.
    The 8/bits values of a byte are read as one little-endian integer (value k at bit 8k)
    and shifted down by k·(8-bits) onto their place; what lands outside the low byte is cut
    by narrowing it to uint8."""
    per_byte = 8 // bits
    if per_byte == 1:
        return q.view(torch.uint32)
    lanes = q.view(torch.int16 if per_byte == 2 else torch.int32)  # positive: top value < 64
    packed = lanes >> (8 - bits)
    packed |= lanes
    for k in range(2, per_byte):
        packed |= lanes >> (k * (8 - bits))
    return packed.to(torch.uint8).view(torch.uint32)
