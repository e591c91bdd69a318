"""What one slot holds: the pieces of a load, and where each lands in slot memory.

A *load* is what one slot holds at a time: a whole layer, or one part of it (attention or
MLP), or a slice of a part when even parts do not fit (the model's family cuts,
`families/`; `plan.py` places).
Every piece is one run of its file; laid out for O_DIRECT (`Load.direct`), a piece sits at
its file offset modulo `DIRECT_ALIGN` inside whole aligned blocks, so the disk DMAs it
straight into the slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tandem.nodes.model.index import ModelIndex, TensorEntry

ALIGN = 64  # bytes; every piece starts aligned so typed views are valid
DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and memory address are multiples of this
DIRECT_MIN = 64 * 1024  # smaller pieces (norms, biases) are not worth a span of their own


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Piece:
    """A tensor, or a row range of it, as it lands in slot memory: one run of its file."""

    key: str  # short name, e.g. "self_attn.q_proj.weight"
    entry: TensorEntry
    rows: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.entry.shape)
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.entry.itemsize

    def span(self) -> tuple[int, int]:
        """(absolute file offset, byte count) of this piece in its file."""
        e = self.entry
        if self.rows is None:
            return e.offset, e.nbytes
        row_bytes = math.prod(e.shape[1:]) * e.itemsize
        r0, r1 = self.rows
        return e.offset + r0 * row_bytes, (r1 - r0) * row_bytes


Op = Literal["attn", "qkv", "o", "mlp", "gate_up", "down"]


@dataclass(frozen=True)
class Part:
    """One compute step over rows [lo, hi) of its op:

    - "attn": the whole attention, o_proj included (lo, hi: all KV heads);
    - "qkv": attention over KV heads [lo, hi), its heads' output kept for "o";
    - "o": o_proj's rows (output features) [lo, hi), added into those residual columns;
    - "mlp": the whole MLP (lo, hi: all intermediate features);
    - "gate_up": gate/up rows [lo, hi), the activation kept for "down";
    - "down": down_proj's rows [lo, hi), added into those residual columns.
    """

    layer: int
    op: Op
    lo: int
    hi: int
    first: bool  # first part of this op in the layer ("qkv", "gate_up": computes the norm)
    last: bool  # last part of this op ("o", "down": the kept output is done with)
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Load:
    """What one slot holds at a time, with each piece's byte offset inside the slot."""

    seq: int  # position in the per-request order
    layer: int
    parts: tuple[Part, ...]
    offsets: tuple[int, ...]  # per piece of all parts, flattened, bytes from the slot start
    nbytes: int  # aligned size
    first_of_layer: bool
    last_of_layer: bool
    resident: bool
    direct: bool = False  # laid out for O_DIRECT reads (see `layout`)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for part in self.parts for p in part.pieces)

    @property
    def weight_bytes(self) -> int:
        """The tensor bytes in this load (`nbytes` adds alignment padding)."""
        return sum(p.nbytes for p in self.pieces)


def _direct_ok(piece: Piece) -> bool:
    """Whether a direct layout gives `piece` an O_DIRECT span of its own."""
    return (
        piece.nbytes >= DIRECT_MIN
        and piece.span()[0] % piece.entry.itemsize == 0  # typed views stay valid
    )


def direct_span(piece: Piece, offset: int) -> tuple[int, int, int] | None:
    """(file offset, slot offset, length) of the aligned O_DIRECT read that lands `piece` at
    `offset` in a `DIRECT_ALIGN`-aligned slot of a `direct` load, or None."""
    if not _direct_ok(piece):
        return None
    file_offset, n = piece.span()
    head = file_offset % DIRECT_ALIGN
    if (offset - head) % DIRECT_ALIGN:
        return None
    return file_offset - head, offset - head, round_up(head + n, DIRECT_ALIGN)


def layout(pieces: list[Piece], direct: bool) -> tuple[list[int], int]:
    """Each piece's offset in slot memory, and the bytes the slot needs.

    Pieces start `ALIGN`-aligned. With `direct`, a piece sits at its file offset modulo
    `DIRECT_ALIGN`, inside a span of whole aligned blocks of its own: the disk then DMAs it
    straight into the slot (O_DIRECT), no copy through the page cache, which on a CPU prefill
    is CPU time taken from compute. Under 8 KiB per piece of at least `DIRECT_MIN` bytes;
    smaller ones are read as before.
    """
    offsets, cursor = [], 0
    for piece in pieces:
        if direct and _direct_ok(piece):
            file_offset, n = piece.span()
            head = file_offset % DIRECT_ALIGN
            start = round_up(cursor, DIRECT_ALIGN)
            offsets.append(start + head)
            cursor = start + round_up(head + n, DIRECT_ALIGN)
        else:
            start = round_up(cursor, ALIGN)
            offsets.append(start)
            cursor = start + piece.nbytes
    return offsets, round_up(cursor, ALIGN)


def slot_size(parts: list[Part] | tuple[Part, ...], direct: bool) -> int:
    return layout([p for part in parts for p in part.pieces], direct)[1]


def dequantized_sizes(index: ModelIndex, part: Part, itemsize: int) -> list[int]:
    """Bytes of each of a part's quantized matrices once dequantized to the compute dtype."""
    sizes = []
    for piece in part.pieces:
        quant = index.quant(part.layer, piece.key.removesuffix(".weight"))
        if quant is not None and piece.key.endswith(".weight"):
            rows, words = piece.shape
            sizes.append(round_up(rows * words * 32 // quant.bits * itemsize, ALIGN))
    return sizes


def dequantized_bytes(index: ModelIndex, part: Part, itemsize: int) -> int:
    """Scratch that holds all of a part's quantized matrices dequantized at once."""
    return sum(dequantized_sizes(index, part, itemsize))
