"""MLX affine dequantization in torch, bit for bit as `mx.dequantize` computes it.

A row of a quantized matrix is a little-endian bit stream of `bits`-bit values packed into
uint32 words from the low bits up (3-, 5- and 6-bit values cross word boundaries); each
`group_size` consecutive values share a scale and a bias: `w = scale * q + bias`, computed
as mlx does, in the scales' dtype, rounding after the product and after the sum. Where the
model computes in a wider dtype than its scales (float32 norms beside float16 scales), the
scales are widened first, as mlx's matmul does.

Runs with plain torch ops, the same on CPU and CUDA, in a few kernels per matrix: for 2, 4
and 8 bits one broadcast shift and one mask unpack every byte's values at once, one stack
interleaves them (`_unpack_aligned`), then one conversion, one product and one sum. `out`
takes the result in place so a caller's scratch bounds the memory; the temporaries (the
unpacked uint8 values, and where the scales are widened a float32 copy) go into `temp`, free
scratch bytes the caller lends, or else into at most `BLOCK_BYTES` allocated here, rows in
blocks of what that holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from tandem.nodes.model.quant import Quant
from tandem.nodes.prefill.loads import ALIGN, round_up  # the plan's scratch: same alignment

BLOCK_BYTES = 16 << 20  # temporaries a call allocates when the caller lends too few
CROSSING_ROW_TEMPS = 40  # bytes of int64 temporaries per value of a crossing (3/5/6-bit) row


def _unpack_aligned(words: torch.Tensor, bits: int, into: torch.Tensor | None) -> torch.Tensor:
    """[R, W] words → [R, W·32/bits] uint8 values, for 2, 4 and 8 bits, in `into` (uint8,
    2·R·W·32/bits bytes). The words are little-endian, so byte k holds the values that start
    at bit 8k: one broadcast shift [1, R, 4W] >> [8/bits, 1, 1] takes every byte's j-th value
    into plane j (long rows: vectorized on a CPU too), one stack interleaves the planes."""
    rows, cols = words.shape[0], words.shape[1] * 32 // bits
    by = words.view(torch.uint8)  # [R, 4W]
    if bits == 8:
        return by
    assert into is not None
    per = 8 // bits  # values per byte
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device).view(per, 1, 1)
    planes = into[: rows * cols].view(per, rows, by.shape[1])
    torch.bitwise_right_shift(by.unsqueeze(0), shifts, out=planes)
    planes.bitwise_and_((1 << bits) - 1)
    q = into[rows * cols : 2 * rows * cols].view(rows, by.shape[1], per)
    torch.stack(planes.unbind(0), dim=-1, out=q)
    return q.view(rows, cols)


def _crossing_index(
    cols: int, bits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value of a row: the word it starts in, and its shift there (3, 5, 6 bits)."""
    offset = torch.arange(cols, dtype=torch.int64, device=device) * bits
    return offset // 32, offset % 32


def _unpack_crossing(
    words: torch.Tensor, bits: int, index: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """[R, W] int32 words → [R, cols] int64 values for bits that cross words (3, 5, 6)."""
    word, shift = index
    w64 = words.to(torch.int64) & 0xFFFFFFFF
    w64 = torch.cat([w64, torch.zeros_like(w64[:, :1])], dim=1)  # a word past the end
    pair = w64[:, word] | (w64[:, word + 1] << 32)  # 64 bits starting at the value's word
    return (pair >> shift) & ((1 << bits) - 1)


def unpack(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The integer values of packed rows: [R, W] → [R, cols]."""
    if bits in (2, 4, 8):
        into = torch.empty(2 * words.shape[0] * cols, dtype=torch.uint8, device=words.device)
        return _unpack_aligned(words, bits, into)
    return _unpack_crossing(words, bits, _crossing_index(cols, bits, words.device))


def work_dtype(scales: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype the dequantization runs in: the scales', widened to the compute dtype."""
    if scales == compute:
        return scales
    return torch.float32


def temp_bytes_per_row(cols: int, bits: int, scales: torch.dtype, dtype: torch.dtype) -> int:
    """Bytes of temporaries `dequantize` needs per row of `cols` values: the unpacked values
    (uint8, in planes and interleaved; int64 ones where values cross words), and a float32
    row where the scales are widened to a compute dtype other than float32."""
    work = work_dtype(scales, dtype)
    unpacked = cols * (CROSSING_ROW_TEMPS if bits not in (2, 4, 8) else 2 if bits != 8 else 0)
    return unpacked + (cols * work.itemsize if work != dtype else 0)


def dequantize(
    words: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    quant: Quant,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    temp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float weights [R, C] in `dtype` from packed `words` [R, C·bits/32] (int32 or uint32
    storage), `scales` and `biases` [R, C/group_size]. `temp`: free uint8 bytes (on the
    device) for the temporaries; a 4- or 8-bit matrix whose temporaries fit takes one block,
    at most 7 kernels."""
    rows, groups = scales.shape
    g = quant.group_size
    cols = groups * g
    if words.shape != (rows, quant.packed_cols(cols)) or biases.shape != scales.shape:
        raise ValueError(
            f"packed {tuple(words.shape)}, scales {tuple(scales.shape)}, biases "
            f"{tuple(biases.shape)} do not describe {quant.bits}-bit groups of {g}"
        )
    if words.dtype != torch.int32:
        words = words.view(torch.int32)
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=words.device)
    work = work_dtype(scales.dtype, dtype)
    aligned = quant.bits in (2, 4, 8)
    per_row = temp_bytes_per_row(cols, quant.bits, scales.dtype, dtype)
    temp, step = _blocks(temp, per_row, rows, aligned, words.device)
    index = None if aligned else _crossing_index(cols, quant.bits, words.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n, wide = r1 - r0, (r1 - r0) * cols * work.itemsize if work != dtype else 0
        if index is not None:
            q = _unpack_crossing(words[r0:r1], quant.bits, index)
        else:  # the float32 rows first (aligned), the unpacked bytes after them
            q = _unpack_aligned(words[r0:r1], quant.bits, temp[wide:] if temp is not None else None)
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


def aligned_front(scratch: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`scratch` from its first `ALIGN` boundary of the address on, where `nbytes` still fit
    there; else all of it."""
    skip = -scratch.data_ptr() % ALIGN
    return scratch[skip:] if skip + nbytes <= scratch.numel() else scratch


def _blocks(
    temp: torch.Tensor | None, per_row: int, rows: int, aligned: bool, device: torch.device
) -> tuple[torch.Tensor | None, int]:
    """(the temporaries' bytes, rows per block): a crossing width allocates int64
    temporaries of its own, blocks of what `BLOCK_BYTES` holds; 8 bits in the working dtype
    need none, one block."""
    if not aligned:
        return None, max(1, BLOCK_BYTES // per_row)
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
        rows, cols = view.shape[0], view.shape[1] * 32 // quant.bits
        nbytes = rows * cols * torch.finfo(self._dtype).bits // 8
        scales, biases = self._views[f"{module}.scales"], self._views[f"{module}.biases"]
        per_row = temp_bytes_per_row(cols, quant.bits, scales.dtype, self._dtype)
        temps = min(per_row * rows, BLOCK_BYTES) if quant.bits in (2, 4, 8) else 0
        start = self._place(key, nbytes, temps)
        dest = self._scratch[start : start + nbytes].view(self._dtype)
        self._cursor = start + round_up(nbytes, ALIGN)
        free = self._scratch[self._cursor :]  # holds nothing asked for: the temporaries' room
        out = dequantize(view, scales, biases, quant, self._dtype, dest.view(rows, cols), free)
        self._done[key] = out
        return out

    def _place(self, key: str, nbytes: int, temps: int = 0) -> int:
        """Where the next matrix of `nbytes` goes, with `temps` bytes after it for its
        temporaries where the scratch has them (the plan sizes it so; else `dequantize` goes
        in smaller blocks): from the cursor, at an `ALIGN` boundary of the address; else of
        the scratch (a scratch whose own start is not aligned: a matrix kept beats an
        aligned one dequantized again); else the same from the front, starting over (what
        was there is dead, see the class doc)."""
        size, base = self._scratch.numel(), self._scratch.data_ptr()
        for cursor in (self._cursor, 0):  # a matrix kept beats room for temporaries
            for room in dict.fromkeys((round_up(nbytes, ALIGN) + temps, nbytes)):
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
