"""MLX dequantization in torch, bit for bit as `mx.dequantize` computes it (mlx's CPU
backend, the tests' oracle).

A row of a quantized matrix is a little-endian bit stream of `bits`-bit values packed into
uint32 words from the low bits up (3-, 5- and 6-bit values cross word boundaries); each
`group_size` consecutive values share a scale and a bias: `w = scale * q + bias`, computed
as mlx does, in the scales' dtype, rounding after the product and after the sum. Where the
model computes in a wider dtype than its scales (float32 norms beside float16 scales), the
scales are widened first, as mlx's matmul does.

Runs with plain torch ops, the same on CPU and CUDA, in a few kernels per matrix at every
width: 8 values of b bits fill exactly b bytes, and each value lies within one byte (2, 4
bits) or two adjacent ones (3, 5, 6 bits: its window), so one gather takes every value's
window, read as uint8 or int16, and one broadcast shift and one mask leave the values
(`_unpack`; 8-bit values are the bytes themselves); then one conversion, one product and
one sum (on CUDA where `triton` imports, one Triton kernel instead: `dequant_triton.py`,
with these ops as its oracle). `out` takes the result in place so a caller's scratch bounds
the memory; the temporaries (the windows, and where the scales are widened a float32 copy) go
into `temp`, free scratch bytes the caller lends, or else into at most `BLOCK_BYTES`
allocated here, rows in blocks of what that holds.

The fp modes (mxfp4, mxfp8, nvfp4: `quant.py`) store codes, not integers: each byte holds two
e2m1 values (low nibble first) or one e4m3 value, and each group one uint8 scale (e8m0 or
e4m3). mlx decodes value and scale to the output dtype and multiplies there, one rounding (so
a float16 output loses e8m0 scales beyond its range first, as mlx's does); the temporaries are
an int32 index per packed byte, where the scales' indices and values go after. Here that is two
lookups in tables of 256 entries (a byte's values, a scale's value) made once per dtype and
device, and one product: 5 kernels a block at either width (the bytes and the scales widened
to int32 indices, two gathers, the product). NaNs come out where mlx's do, their sign and
payload as the device's arithmetic makes them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType

import torch
from tandem.nodes.model.quant import Quant
from tandem.nodes.prefill.planning.loads import (  # the plan's scratch: same alignment
    ALIGN,
    round_up,
)

BLOCK_BYTES = 16 << 20  # temporaries a call allocates when the caller lends too few


def _span(bits: int) -> int:
    """Bytes of the window that holds any one value: 1 where values stay within bytes (2, 4,
    8 bits), else 2 (a value crosses at most one byte boundary)."""
    return 1 if 8 % bits == 0 else 2


def _window_dtype(span: int) -> torch.dtype:
    return torch.uint8 if span == 1 else torch.int16


def _layout(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of the 8 values that fill `bits` bytes is read: the first byte of its
    window (int64 [8]: the byte the value starts in, except that no window reaches past the
    group's last byte, so the last value's may start a byte earlier), and its shift there
    (the window's dtype, [8]). Made on the device, a few tiny kernels: a tensor from host
    values would wait for the stream."""
    span = _span(bits)
    start = torch.arange(0, 8 * bits, bits, device=device)  # bits: where value j starts
    first = (start >> 3).clamp_(max=bits - span)
    shift = torch.add(start, first, alpha=-8)  # start - 8·first: at most 8·span - bits
    # each int64's low byte or half-word (little-endian, as the words)
    return first, shift.view(_window_dtype(span))[:: 8 // span]


def _unpack(
    words: torch.Tensor,
    bits: int,
    layout: tuple[torch.Tensor, torch.Tensor] | None,
    into: torch.Tensor | None,
) -> torch.Tensor:
    """[R, W] words → [R, W·32/bits] values: for 8 bits the bytes themselves, else in `into`
    (uint8, `_span` bytes per value), as uint8 or int16. The words are little-endian, so a
    group of 8 values is b consecutive bytes, value j from bit j·b on; `unfold` views every
    window of the group's bytes, one gather picks each value's, one shift and one mask cut
    the value out (an int16's kept bits stay below the sign bits its shift brings in)."""
    by = words.view(torch.uint8)  # [R, 4W]
    if bits == 8:
        return by
    assert layout is not None and into is not None
    first, shift = layout
    span, rows, groups = _span(bits), by.shape[0], by.shape[1] // bits
    windows = by.view(rows, groups, bits).unfold(2, span, 1)  # [R, G, b-span+1, span]
    picked = into[: rows * groups * 8 * span].view(rows, groups, 8, span)
    torch.index_select(windows, 2, first, out=picked)
    q = picked.view(_window_dtype(span)).view(rows, groups, 8)  # an int16's low byte first
    q.bitwise_right_shift_(shift).bitwise_and_((1 << bits) - 1)
    return q.view(rows, groups * 8)


def work_dtype(scales: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype the dequantization runs in: the scales', widened to the compute dtype."""
    if scales == compute:
        return scales
    return torch.float32


def temp_bytes_per_row(cols: int, bits: int, scales: torch.dtype, dtype: torch.dtype) -> int:
    """Bytes of temporaries `dequantize` needs per row of `cols` values: the unpacked values
    (a window of one or two bytes each; none at 8 bits, whose values are the packed bytes),
    and a float32 row where the scales are widened to a compute dtype other than float32.
    uint8 `scales` are an fp mode's: an int32 index per packed byte (the scales' indices and
    values reuse that room)."""
    if scales == torch.uint8:
        return cols * bits // 8 * 4
    work = work_dtype(scales, dtype)
    unpacked = _span(bits) * cols if bits != 8 else 0
    return unpacked + (cols * work.itemsize if work != dtype else 0)


def dequantize(
    words: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor | None,
    quant: Quant,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    temp: torch.Tensor | None = None,
    *,
    triton: bool = True,
) -> torch.Tensor:
    """Float weights [R, C] in `dtype` from packed `words` [R, C·bits/32] (int32 or uint32
    storage), `scales` and `biases` [R, C/group_size] (an fp mode's: uint8 scales, no
    biases). `temp`: free uint8 bytes (on the device) for the temporaries; a matrix whose
    temporaries fit takes one block: at most 11 kernels at any width (4 at 8 bits; 5 in an
    fp mode), however many rows. On CUDA where `triton` imports, an affine matrix whose rows
    are contiguous is one Triton kernel, no temporaries; `triton=False`: the torch ops."""
    rows, groups = scales.shape
    g = quant.group_size
    cols = groups * g
    described = words.shape == (rows, quant.packed_cols(cols)) and (
        biases.shape == scales.shape if biases is not None else scales.dtype == torch.uint8
    )
    if not described or (biases is None) == quant.biases:
        raise ValueError(
            f"packed {tuple(words.shape)}, scales {tuple(scales.shape)} {scales.dtype}, biases "
            f"{None if biases is None else tuple(biases.shape)} do not describe {quant.bits}-bit "
            f"groups of {g} ({quant.mode})"
        )
    if words.dtype != torch.int32:
        words = words.view(torch.int32)
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=words.device)
    if biases is None:
        return _dequantize_fp(words, scales, quant, out, temp)
    work = work_dtype(scales.dtype, dtype)
    rowwise = all(t.stride(-1) == 1 for t in (words, scales, biases, out))
    if triton and words.is_cuda and rowwise and (fast := _triton(words.device)) is not None:
        return fast.dequantize_affine(words, scales, biases, quant.bits, g, out, work)
    per_row = temp_bytes_per_row(cols, quant.bits, scales.dtype, dtype)
    temp, step = _blocks(temp, per_row, rows, words.device)
    layout = _layout(quant.bits, words.device) if quant.bits != 8 else None  # once a matrix
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n, wide = r1 - r0, (r1 - r0) * cols * work.itemsize if work != dtype else 0
        # the float32 rows first (their alignment), the values' windows after them
        q = _unpack(words[r0:r1], quant.bits, layout, temp[wide:] if temp is not None else None)
        if work == dtype:  # in the output itself
            w = out[r0:r1]
        elif temp is not None:
            w = temp[:wide].view(work)
        else:
            w = torch.empty((n, cols), dtype=work, device=words.device)
        w = w.view(n, groups, g)
        w.copy_(q.view(n, groups, g))
        # two roundings, as mlx: the product, then the sum; narrower scales are widened in
        # the kernel (exactly), as `.to(work)` would
        w.mul_(scales[r0:r1].unsqueeze(-1))
        w.add_(biases[r0:r1].unsqueeze(-1))
        if work != dtype:
            out[r0:r1].copy_(w.view(n, cols))
    return out


@functools.cache
def _triton(device: torch.device) -> ModuleType | None:
    """`dequant_triton` where `triton` imports and its kernel runs on `device`, else None:
    asked once a device (imported here, so a node without triton never loads it)."""
    try:
        from tandem.nodes.prefill.kernels import dequant_triton
    except ImportError:
        return None
    return dequant_triton if dequant_triton.usable(device) else None


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 codes 0-7; 8-15 the same, negative


@functools.cache
def _tables(mode: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(each byte's values [256, 8/bits], each scale byte's value [256]) in `dtype` on
    `device`, decoded as mlx decodes them; made on the host once per dtype and device."""
    byte = torch.arange(256)
    e2m1 = torch.tensor(E2M1 + tuple(-v for v in E2M1))  # float32 [16]
    e4m3 = byte.to(torch.uint8).view(torch.float8_e4m3fn).float()  # 0x7f, 0xff: NaN
    if mode == "mxfp8":
        values = e4m3[:, None]
    else:  # a byte's two values, the low nibble's first
        values = torch.stack([e2m1[byte & 15], e2m1[byte >> 4]], dim=1)
    if mode == "nvfp4":
        scale = e4m3
    else:  # e8m0 as mlx reads it: the bfloat16 of exponent s; 0 its subnormal 2^-127, 255 inf
        bits = (byte << 7).to(torch.int16)
        bits[0] = 0x40
        scale = bits.view(torch.bfloat16)
    return values.to(dtype).to(device), scale.to(dtype).to(device)


def _dequantize_fp(
    words: torch.Tensor,
    scales: torch.Tensor,
    quant: Quant,
    out: torch.Tensor,
    temp: torch.Tensor | None,
) -> torch.Tensor:
    """`dequantize` in an fp mode: per block, the packed bytes widened to int32 indices in
    the temporaries' room, each byte's values gathered into `out`, then the scales' indices
    and values in the same room (the bytes' indices are spent), and one product in place."""
    rows, groups = scales.shape
    g, dtype = quant.group_size, out.dtype
    values, scale_of = _tables(quant.mode, dtype, words.device)
    per_byte = values.shape[1]
    if temp is not None:  # int32 views need a 4-byte boundary of the storage
        temp = temp[-temp.storage_offset() % 4 :]
    per_row = temp_bytes_per_row(groups * g, quant.bits, scales.dtype, dtype)
    temp, step = _blocks(temp, per_row, rows, words.device)
    assert temp is not None
    by = words.view(torch.uint8)  # [R, C/per_byte]
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n, w = r1 - r0, out[r0:r1]
        codes = temp[: n * by.shape[1] * 4].view(torch.int32)
        codes.view(n, -1).copy_(by[r0:r1])
        torch.index_select(values, 0, codes, out=w.view(-1, per_byte))
        at = n * groups * 4
        index = temp[:at].view(torch.int32)
        index.view(n, groups).copy_(scales[r0:r1])
        scale = temp[at : at + n * groups * dtype.itemsize].view(dtype)
        torch.index_select(scale_of, 0, index, out=scale)
        w.view(n, groups, g).mul_(scale.view(n, groups, 1))  # in `dtype`, as mlx: one rounding
    return out


def aligned_front(scratch: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`scratch` from its first `ALIGN` boundary of the address on, where `nbytes` still fit
    there; else all of it."""
    skip = -scratch.data_ptr() % ALIGN
    return scratch[skip:] if skip + nbytes <= scratch.numel() else scratch


def _blocks(
    temp: torch.Tensor | None, per_row: int, rows: int, device: torch.device
) -> tuple[torch.Tensor | None, int]:
    """(the temporaries' bytes, rows per block): blocks of what the lent or allocated bytes
    hold; 8 bits in the working dtype need none, one block."""
    if not per_row:
        return temp, rows
    temp = _lent_or_new(temp, per_row, rows, device)
    return temp, max(1, temp.numel() // per_row)


def _lent_or_new(
    temp: torch.Tensor | None, per_row: int, rows: int, device: torch.device
) -> torch.Tensor:
    """The caller's free bytes when they hold a row's temporaries at least (the rows then go
    in blocks of what they hold: a plan lends what its budget allows); else new bytes: all
    that is needed, at most `BLOCK_BYTES` (and at least a row's)."""
    want = max(per_row, min(per_row * rows, BLOCK_BYTES))
    if temp is not None and temp.numel() >= per_row:
        return temp
    return torch.empty(want, dtype=torch.uint8, device=device)


class DequantizedWeights(Mapping[str, torch.Tensor]):
    """A part's weights by short name, each quantized matrix dequantized into `scratch` when
    it is asked for (its `.scales`/`.biases` are consumed, not listed).

    Matrices stay in the scratch while they fit, so a part whose matrices all fit is
    dequantized once per load. When one does not fit, the scratch starts over at its front.
    That is safe because the blocks ask for a weight right before using it and keep none
    across another request, except the last one asked for (o_proj through attention's query
    chunks); so a plan may size the scratch for one matrix, which then is dequantized again
    per token chunk.
    """

    def __init__(
        self,
        views: dict[str, torch.Tensor],
        quant_of: Callable[[str], Quant | None],
        scratch: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        self._views = views
        self._quant_of = quant_of
        self._scratch = scratch  # uint8 on the device
        self._dtype = dtype
        self._done: dict[str, torch.Tensor] = {}
        self._cursor = 0
        self._keys = [k for k in views if not k.endswith((".scales", ".biases"))]

    def __getitem__(self, key: str) -> torch.Tensor:
        view = self._views[key]
        module = key.removesuffix(".weight")
        quant = self._quant_of(module) if key != module else None
        if quant is None or view.is_floating_point():  # float: dequantized already (resident)
            return view
        if key in self._done:
            return self._done[key]
        *lead, words = view.shape  # [.., R, W]: a 3-D one is per head (MLA's embed_q)
        rows, cols = math.prod(lead), words * 32 // quant.bits
        nbytes = rows * cols * torch.finfo(self._dtype).bits // 8
        scales, biases = self._views[f"{module}.scales"], self._views.get(f"{module}.biases")
        if len(lead) > 1:
            view, scales = view.reshape(rows, words), scales.reshape(rows, -1)
            biases = None if biases is None else biases.reshape(rows, -1)
        per_row = temp_bytes_per_row(cols, quant.bits, scales.dtype, self._dtype)
        temps = min(per_row * rows, BLOCK_BYTES)
        start = self._place(key, nbytes, temps, per_row)
        dest = self._scratch[start : start + nbytes].view(self._dtype)
        self._cursor = start + round_up(nbytes, ALIGN)
        free = self._scratch[self._cursor :]  # holds nothing asked for: the temporaries' room
        out = dequantize(view, scales, biases, quant, self._dtype, dest.view(rows, cols), free)
        self._done[key] = out = out.view(*lead, cols)
        return out

    def _place(self, key: str, nbytes: int, temps: int = 0, least: int = 0) -> int:
        """Where the next matrix of `nbytes` goes, with `temps` bytes after it for its
        temporaries where the scratch has them (the plan sizes it so; else, `least` bytes
        at least, one row's: `dequantize` goes in smaller blocks): from the cursor, at an
        `ALIGN` boundary of the address; else of the scratch (a scratch whose own start is
        not aligned: a matrix kept beats an aligned one dequantized again); else the same
        from the front, starting over (what was there is dead, see the class doc)."""
        size, base = self._scratch.numel(), self._scratch.data_ptr()
        rooms = (round_up(nbytes, ALIGN) + temps, round_up(nbytes, ALIGN) + least, nbytes)
        # a matrix kept beats room for all its temporaries, not room for one row of them
        for cursor, tries in ((self._cursor, rooms[:2]), (0, rooms)):
            for room in dict.fromkeys(tries):
                for start in (round_up(base + cursor, ALIGN) - base, cursor):
                    if start + room <= size:
                        if cursor == 0 and self._cursor:
                            self._done.clear()
                        return start
        raise ValueError(f"{key}: {nbytes} B dequantized exceed the {size} B scratch")

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
