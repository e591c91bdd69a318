"""MLX affine dequantization in torch, bit for bit as `mx.dequantize` computes it.

A row of a quantized matrix is a little-endian bit stream of `bits`-bit values packed into
uint32 words from the low bits up (3-, 5- and 6-bit values cross word boundaries); each
`group_size` consecutive values share a scale and a bias: `w = scale * q + bias`, computed
as mlx does, in the scales' dtype, rounding after the product and after the sum. Where the
model computes in a wider dtype than its scales (float32 norms beside float16 scales), the
scales are widened first, as mlx's matmul does.

Runs with plain torch ops, the same on CPU and CUDA; `out` takes the result in place so a
caller's scratch bounds the memory, and rows go in blocks so temporaries stay small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from tandem.nodes.model.quant import Quant
from tandem.nodes.prefill.loads import ALIGN  # the plan sizes the scratch with the same alignment

BLOCK_ELEMENTS = 1 << 21  # values per row block: temporaries of a few MiB


def _unpack_aligned(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, W] words → [R, W·32/bits] uint8 values, for 2, 4 and 8 bits: byte by byte (the
    words are little-endian, so byte k holds the values that start at bit 8k)."""
    by = words.view(torch.uint8)  # [R, 4W]
    if bits == 8:
        return by
    mask = (1 << bits) - 1
    q = torch.stack([(by >> shift) & mask for shift in range(0, 8, bits)], dim=-1)
    return q.view(words.shape[0], words.shape[1] * 32 // bits)


def _unpack_crossing(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """[R, W] int32 words → [R, cols] int64 values for bits that cross words (3, 5, 6)."""
    w64 = words.to(torch.int64) & 0xFFFFFFFF
    w64 = torch.cat([w64, torch.zeros_like(w64[:, :1])], dim=1)  # a word past the end
    offset = torch.arange(cols, dtype=torch.int64, device=words.device) * bits
    word, shift = offset // 32, offset % 32
    pair = w64[:, word] | (w64[:, word + 1] << 32)  # 64 bits starting at the value's word
    return (pair >> shift) & ((1 << bits) - 1)


def unpack(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The integer values of packed rows: [R, W] → [R, cols]."""
    if bits in (2, 4, 8):
        return _unpack_aligned(words, bits)
    return _unpack_crossing(words, bits, cols)


def work_dtype(scales: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype the dequantization runs in: the scales', widened to the compute dtype."""
    if scales == compute:
        return scales
    return torch.float32


def dequantize(
    words: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    quant: Quant,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float weights [R, C] in `dtype` from packed `words` [R, C·bits/32] (int32 or uint32
    storage), `scales` and `biases` [R, C/group_size]."""
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
    step = max(1, BLOCK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q = unpack(words[r0:r1], quant.bits, cols).view(r1 - r0, groups, g)
        # in the output itself where it has the working dtype, else in a temporary
        w = (
            out[r0:r1].view(r1 - r0, groups, g)
            if work == dtype
            else torch.empty_like(q, dtype=work)
        )
        w.copy_(q)
        w.mul_(scales[r0:r1].to(work).unsqueeze(-1))  # two roundings, as mlx: the product,
        w.add_(biases[r0:r1].to(work).unsqueeze(-1))  # then the sum
        if work != dtype:
            out[r0:r1] = w.view(r1 - r0, cols)
    return out


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
        if quant is None:
            return view
        if key in self._done:
            return self._done[key]
        rows, cols = view.shape[0], view.shape[1] * 32 // quant.bits
        nbytes = rows * cols * torch.finfo(self._dtype).bits // 8
        if self._cursor + nbytes > self._scratch.numel():
            self._done.clear()  # start over: what was there is dead (see the class doc)
            self._cursor = 0
        if nbytes > self._scratch.numel():
            raise ValueError(
                f"{key}: {nbytes} B dequantized exceed the {self._scratch.numel()} B scratch"
            )
        dest = self._scratch[self._cursor : self._cursor + nbytes].view(self._dtype)
        self._cursor += -(-nbytes // ALIGN) * ALIGN
        scales, biases = self._views[f"{module}.scales"], self._views[f"{module}.biases"]
        out = dequantize(view, scales, biases, quant, self._dtype, out=dest.view(rows, cols))
        self._done[key] = out
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
