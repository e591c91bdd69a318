"""MLX affine dequantization as one Triton kernel, bit for bit as `dequant.py`'s torch ops
(its oracle: `tests/test_dequant_triton.py` runs this kernel in Triton's interpreter).

Imported only by `dequant.dequantize`, lazily, where the tensors are on CUDA: a node without
`triton` never imports this module. One program takes `BLOCK` values of one row: value c of a
row starts at bit c·bits of the row's bytes (little-endian words, from the low bits up), so it
is the byte at (c·bits)/8 shifted right by (c·bits) mod 8, with the next byte above it where
the value crosses into it (3, 5, 6 bits); its group's scale and bias follow from c/group_size.
No temporaries, one launch per matrix at every width (the torch path: up to 11 kernels a
block of rows, and scratch for the unpacked values).

Rounding as the torch path: the product and the sum each rounded to the working dtype (the
scales', or float32 where the output is wider or of another kind: `dequant.work_dtype`), then
the result to the output's. A half-precision product or sum is computed in float32 and rounded
once: exact, as float32 holds every product of two half-precision values and rounds their sum
innocuously (24 ≥ 2·11 + 2 bits). FMA contraction is off (`OPTIONS`), which would round the
float32 product and sum only once.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

BLOCK = 1024  # values of one row a program takes (fewer for a narrower row)
MIN_CAPABILITY = (7, 0)  # Triton's oldest NVIDIA architecture (Volta)
# no FMA contraction: it would round float32's product and sum once, the torch path twice
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}

log = logging.getLogger(__name__)


@triton.jit
def _affine(
    words,  # uint8 [R, C·bits/8]: the packed rows' bytes
    scales,  # [R, C/group]
    biases,  # [R, C/group], the scales' dtype
    out,  # [R, C]
    cols,
    words_row,  # row strides, in elements
    scales_row,
    biases_row,
    out_row,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    NARROW: tl.constexpr,  # round the product and the sum to the scales' dtype (else float32)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < cols
    bit = col * BITS
    at = words + row * words_row + (bit >> 3)
    window = tl.load(at, mask=inside, other=0).to(tl.int32)
    if 8 % BITS != 0:  # 3, 5, 6 bits: a value may run on into the next byte
        crosses = inside & ((bit & 7) + BITS > 8)
        window = window | (tl.load(at + 1, mask=crosses, other=0).to(tl.int32) << 8)
    q = (window >> (bit & 7)) & ((1 << BITS) - 1)
    group = col // GROUP
    scale = tl.load(scales + row * scales_row + group, mask=inside, other=0)
    bias = tl.load(biases + row * biases_row + group, mask=inside, other=0)
    w = q.to(tl.float32) * scale.to(tl.float32)
    if NARROW:
        w = _rounded(w, scale.dtype).to(tl.float32)
    w = w + bias.to(tl.float32)
    if NARROW:
        w = _rounded(w, scale.dtype).to(tl.float32)
    tl.store(out + row * out_row + col, _rounded(w, out.dtype.element_ty), mask=inside)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 `x` in `dtype`, to nearest even. bfloat16 by hand, as torch's CPU rounds it
    (NaN: 0x7fc0): what Triton's interpreter makes of `.to(tl.bfloat16)` rounds ties away
    from zero, and these integer ops are exact on every backend."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        b = tl.where(x != x, 0x7FC00000, b)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


def usable(device: torch.device) -> bool:
    """Whether the kernel runs on the CUDA card `device`: Triton targets it, and a first
    launch builds and runs (it needs a C compiler for its launcher, and the driver)."""
    if torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return False
    words = torch.zeros((1, 8), dtype=torch.int32, device=device)
    halves = torch.zeros((1, 1), dtype=torch.float16, device=device)
    out = torch.empty((1, 64), dtype=torch.float16, device=device)
    try:
        dequantize_affine(words, halves, halves, 4, 64, out, torch.float16)
    except Exception as e:  # whatever building or launching raised: the torch ops serve
        log.warning("Triton dequantization unusable on %s, torch's serves: %r", device, e)
        return False
    return True


def dequantize_affine(
    words: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    out: torch.Tensor,
    work: torch.dtype,
) -> torch.Tensor:
    """`out` [R, C] from int32 `words` [R, C·bits/32], `scales` and `biases` [R, C/group_size]
    (each contiguous along its rows), in one launch on the current stream; the product and
    the sum rounded to `work` (`dequant.work_dtype`: the scales' dtype, or float32)."""
    assert work in (scales.dtype, torch.float32)
    rows, cols = out.shape
    block = min(BLOCK, triton.next_power_of_2(cols))
    grid = (rows, triton.cdiv(cols, block))
    by = words.view(torch.uint8)
    _affine[grid](
        by, scales, biases, out, cols,
        by.stride(0), scales.stride(0), biases.stride(0), out.stride(0),
        BITS=bits, GROUP=group_size, NARROW=work != torch.float32, BLOCK=block, **OPTIONS,
    )  # fmt: skip
    return out
