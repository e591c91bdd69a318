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

Plain torch ops, the same on CPU and CUDA, vectorized over all groups of all the tensors
given at once (a layer's K and V), so each op runs once a layer: the values widened side by
side (into a `Scratch` the caller keeps from layer to layer: on a CPU, first touches of a
fresh allocation's pages cost about as much as the quantizing), a min and a max reduction,
~15 small ops on the [groups, 1] scales, four elementwise passes over the values in place,
one narrowing to bytes, and for 4 and 2 bits a shift-and-or over int32 lanes to pack them.
Divisions are always tensor by tensor: CUDA turns a division by a Python (CPU) scalar into a
multiplication by its reciprocal, which rounds differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

KV_BITS = (2, 4, 8)  # bit widths that pack whole values into bytes
GROUP_SIZES = (32, 64, 128)
EPS = 1e-7  # mlx's floor on the magnitude of a scale (compared as a float32)
MAGIC = float(1 << 23)  # 2**23: adding it to v in [0, 2**23) leaves round(v) in the low bits
TINY = 1e-30  # the divisor of a group whose scale is 0

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
    """`quantize` of each x (of one dtype and device; a layer's K and V), all in one set of
    ops: the xs widened side by side into `scratch` (else a fresh allocation) are one run of
    groups, so each op runs once however many xs there are (each costs a kernel launch, or
    µs of dispatch). Each x's words, scales and biases are views of the joint results."""
    _check(xs, group_size, bits)
    n_bins = (1 << bits) - 1
    work = (scratch or Scratch()).take(sum(x.numel() for x in xs), xs[0].device)
    at = 0
    for x in xs:  # widened exactly, read by value (x may be a strided view)
        work[at : at + x.numel()].view(x.shape).copy_(x)
        at += x.numel()
    g = work.view(-1, group_size)  # [M, gs] float32: every group of every x, in order
    # amin and amax apart: aminmax over a short last axis is several times slower
    w_min, w_max = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)  # [M, 1]
    if kernel == "gpu":
        w_max = w_max.clamp_min_(0.0)
    low_edge = w_min.abs() > w_max.abs()
    params = w_min.new_empty((2, *w_min.shape))  # scale, bias: narrowed in one op at the end
    edge = torch.where(low_edge, w_min, w_max, out=params[1])
    step = (w_max - w_min).div_(torch.full_like(w_max, n_bins)).clamp_min_(EPS)
    step = torch.where(low_edge, step, step.neg())  # divisors are tensors, never scalars
    q0 = _round(edge / step, kernel)
    at_zero = q0 == 0
    scale = torch.where(at_zero, step, edge / q0, out=params[0])
    bias = edge.masked_fill_(at_zero, 0.0)
    # A constant group past ~3e31 overflows q0 and leaves scale ±0: its values are 0, as
    # mlx's CPU kernel casts the NaN of 0/0. Divide by a tiny number there instead: any
    # other scale is at least 5e-8 in magnitude, so adding TINY leaves it as it is.
    divisor = scale + TINY
    scales, biases = params.to(xs[0].dtype)

    v = g.sub_(bias).div_(divisor).clamp_(0, n_bins)  # [M, gs] in [0, n_bins]
    if kernel == "cpu":
        # + 2**23 rounds half to even into the low mantissa bits: the value is the low byte
        q = v.add_(MAGIC).view(torch.int32).to(torch.uint8)
    else:
        q = _round(v, kernel).to(torch.uint8)
    words = _pack(q.view(-1), bits)  # [M·gs·bits/32] uint32

    out, w_at, g_at = [], 0, 0
    for x in xs:
        *lead, d = x.shape
        n_words, n_groups = x.numel() * bits // 32, x.numel() // group_size
        out.append(
            (
                words[w_at : w_at + n_words].view(*lead, d * bits // 32),
                scales[g_at : g_at + n_groups].view(*lead, -1),
                biases[g_at : g_at + n_groups].view(*lead, -1),
            )
        )
        w_at, g_at = w_at + n_words, g_at + n_groups
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
    """Values q [M] uint8 (each < 2**bits; M a multiple of 4) packed from the low bits up:
    value k of a byte at bit k·bits, bytes in order, so the little-endian words hold value i
    at bit i·bits. Four values are read as one little-endian int32 lane (value k at bit 8k;
    positive, the top value < 64) and shifted down by multiples of 8-bits onto their places;
    the bytes that hold them are kept by narrowing (a 4-bit lane's bytes 0 and 2, through
    its int16 halves; a 2-bit lane's byte 0), which cuts what landed above them."""
    per_byte = 8 // bits
    if per_byte == 1:
        return q.view(torch.uint32)
    lanes = q.view(torch.int32)
    packed = lanes >> (8 - bits)
    packed |= lanes
    if per_byte == 2:
        return packed.view(torch.int16).to(torch.uint8).view(torch.uint32)
    for k in range(2, per_byte):
        packed |= lanes >> (k * (8 - bits))
    return packed.to(torch.uint8).view(torch.uint32)
