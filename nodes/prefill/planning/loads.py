"""What one slot holds: the pieces of a load, and where each lands in slot memory.

A *load* is what one slot holds at a time: a whole layer, or one part of it (attention or
MLP), or a slice of a part when even parts do not fit (the model's family cuts,
`families/`; `plan.py` places).
A piece is a tensor, a range of its rows (dim 0), a range of its columns (the last dim:
a tensor-parallel rank's share of o_proj or down_proj), or both. A whole tensor or a row range
is one run of its file; a column range is one run per line of the last dim, `stride` apart
(`Piece.runs`), read by a strided copy (`reads.py`), never by O_DIRECT. In slot memory every
piece is contiguous, laid out as its `shape`, and starts `ALIGN`-aligned (safetensors only
promises 8 bytes in the file; cuBLASLt's fast kernels want 16, TMA more). Laid out for
O_DIRECT (`Load.direct`), a one-run piece's span is whole aligned blocks, read straight into
the slot: its bytes *land* at their file offset modulo `DIRECT_ALIGN` (`landing`), at most
`ALIGN` - 1 bytes past the piece's offset, and the mover moves them down (`moves`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from tandem.nodes.model.index import ModelIndex, TensorEntry

ALIGN = 256  # bytes; every piece (every weight the blocks get) starts aligned to this
DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and memory address are multiples of this
DIRECT_MIN = 64 * 1024  # smaller pieces (norms, biases) are not worth a span of their own


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Runs(NamedTuple):
    """Where a piece's bytes are in its file: `count` runs of `size` bytes, each `stride`
    bytes after the one before, the first at `first` (absolute file offset)."""

    first: int
    size: int
    stride: int
    count: int


@dataclass(frozen=True)
class Piece:
    """A tensor, or a range of its rows (dim 0) and/or of its columns (its last dim), as it
    lands in slot memory: contiguous, laid out as `shape`. `cols` counts elements of the
    stored dtype (an MLX-packed matrix's uint32 words, its scales' and biases' groups); on a
    3-D tensor `rows` cut dim 0 and `cols` the last, the middle dims whole."""

    key: str  # short name, e.g. "self_attn.q_proj.weight"
    entry: TensorEntry
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.cols is None:
            return
        shape, (c0, c1) = self.entry.shape, self.cols
        if not shape or not 0 <= c0 < c1 <= shape[-1]:
            raise ValueError(f"{self.key}: columns {self.cols} of a tensor of shape {shape}")
        if len(shape) == 1 and self.rows is not None:
            raise ValueError(f"{self.key}: rows and columns of a 1-D tensor")

    # cached: a plan of a model with thousands of experts asks for them millions of times
    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.entry.shape)
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        if self.cols is not None:
            shape[-1] = self.cols[1] - self.cols[0]
        return tuple(shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.entry.itemsize

    @functools.cached_property
    def _runs(self) -> Runs:
        e = self.entry
        if self.cols is None:
            if self.rows is None:
                return Runs(e.offset, e.nbytes, e.nbytes, 1)
            row_bytes = math.prod(e.shape[1:]) * e.itemsize
            r0, r1 = self.rows
            n = (r1 - r0) * row_bytes
            return Runs(e.offset + r0 * row_bytes, n, n, 1)
        line = e.shape[-1] * e.itemsize  # bytes of one line of the last dim
        per_row = math.prod(e.shape[1:-1])  # lines per row of dim 0 (1-D: the one line)
        r0, r1 = (self.rows or (0, e.shape[0])) if len(e.shape) > 1 else (0, 1)
        c0, c1 = self.cols
        first = e.offset + r0 * per_row * line + c0 * e.itemsize
        size, count = (c1 - c0) * e.itemsize, (r1 - r0) * per_row
        if size == line or count == 1:  # whole lines, or a single one: one run after all
            return Runs(first, size * count, size * count, 1)
        return Runs(first, size, line, count)

    def runs(self) -> Runs:
        """Where this piece's bytes are in its file: one run, or one per line (`strided`)."""
        return self._runs

    @property
    def strided(self) -> bool:
        """More than one run of its file (a column range): read by a strided copy."""
        return self._runs.count > 1

    @functools.cached_property
    def _span(self) -> tuple[int, int]:
        first, size, stride, count = self._runs
        return first, (count - 1) * stride + size

    def span(self) -> tuple[int, int]:
        """(absolute file offset, byte count) of the file range this piece's runs enclose:
        its bytes, unless it is `strided` (then the other columns' too)."""
        return self._span


Op = Literal[
    "attn", "qkv", "o", "mlp", "gate_up", "down",  # dense layers
    "router", "experts", "shared",  # mixtures of experts
    "linear",  # a linear-attention layer's mixer
]  # fmt: skip


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
    partial: bool = False  # some parts left out (experts no token chose): never a tier's

    @property
    def routed(self) -> bool:
        """Only experts: read once the layer's router has chosen (`routed_only`)."""
        return bool(self.parts) and all(part.op == "experts" for part in self.parts)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for part in self.parts for p in part.pieces)

    @property
    def weight_bytes(self) -> int:
        """The tensor bytes in this load (`nbytes` adds alignment padding)."""
        return sum(p.nbytes for p in self.pieces)


def routed_only(load: Load, used: frozenset[int]) -> Load | None:
    """The experts `used` of a routed load, at their places in its slot (the others'
    bytes are not read); None when it holds none of them."""
    keep = [i for i, part in enumerate(load.parts) if part.lo in used]
    if len(keep) == len(load.parts):
        return load
    if not keep:
        return None
    offsets = iter(load.offsets)
    placed = [[next(offsets) for _ in part.pieces] for part in load.parts]
    return replace(
        load, parts=tuple(load.parts[i] for i in keep),
        offsets=tuple(o for i in keep for o in placed[i]), partial=True,
    )  # fmt: skip


def _direct_ok(piece: Piece) -> bool:
    """Whether a direct layout gives `piece` an O_DIRECT span of its own."""
    return (
        piece.nbytes >= DIRECT_MIN
        and not piece.strided  # a column range: many runs, read by a strided copy
        and piece.span()[0] % piece.entry.itemsize == 0  # typed views stay valid
    )


def direct_span(piece: Piece, offset: int) -> tuple[int, int, int] | None:
    """(file offset, slot offset, length) of the aligned O_DIRECT read that puts `piece`
    (placed at `offset` in a `DIRECT_ALIGN`-aligned slot of a `direct` load) in its span, or
    None. The piece's bytes land `head % ALIGN` bytes past `offset` (`landing`)."""
    if not _direct_ok(piece):
        return None
    file_offset, n = piece.span()
    head = file_offset % DIRECT_ALIGN
    start = offset - (head - head % ALIGN)
    if start % DIRECT_ALIGN:
        return None
    return file_offset - head, start, round_up(head + n, DIRECT_ALIGN)


def landing(piece: Piece, offset: int, direct: bool) -> int:
    """Where a read of a `direct` (or not) load puts the first byte of `piece`, whose place
    is `offset`: there, or inside its O_DIRECT span at the file offset modulo
    `DIRECT_ALIGN` (always, whichever way the bytes are read, so a load's landed layout is
    one). Less than `ALIGN` bytes past `offset`."""
    span = direct_span(piece, offset) if direct else None
    return offset if span is None else span[1] + piece.span()[0] - span[0]


def moves(load: Load) -> list[tuple[int, int, int]]:
    """(slot offset, landed offset, bytes): the copies that take a load's bytes from where
    its reads land them to its `offsets`, every piece covered once. Neighbours that landed
    alike go in one copy (with the padding between them), so a load whose pieces all landed
    in place is one copy of its `nbytes`."""
    runs: list[tuple[int, int, int]] = []
    end = 0
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        shift = landing(piece, off, load.direct) - off
        beside = not load.partial or off - end < DIRECT_ALIGN  # no left-out piece between
        if runs and runs[-1][1] - runs[-1][0] == shift and beside:
            dst, src, _ = runs[-1]
            runs[-1] = (dst, src, off + piece.nbytes - dst)
        else:
            start = end if shift == 0 else off  # in place: from where the last copy ended
            runs.append((start, start + shift, off + piece.nbytes - start))
        end = off + piece.nbytes
    tail = not load.partial or load.nbytes - end < DIRECT_ALIGN
    if runs and runs[-1][1] == runs[-1][0] and tail:  # the tail's padding, one copy of nbytes
        dst, src, _ = runs[-1]
        runs[-1] = (dst, src, load.nbytes - dst)
    return runs


def layout(pieces: list[Piece], direct: bool, start: int = 0) -> tuple[list[int], int]:
    """Each piece's offset in slot memory, and the bytes the slot needs.

    Pieces start `ALIGN`-aligned. With `direct`, a piece's span is whole aligned blocks of
    its own, where it lands at its file offset modulo `DIRECT_ALIGN` (`landing`): the disk
    then DMAs it straight into the slot (O_DIRECT), no copy through the page cache, which on
    a CPU prefill is CPU time taken from compute; its offset is the `ALIGN` boundary at or
    below where it lands. Under 8 KiB per piece of at least `DIRECT_MIN` bytes; smaller ones
    are read as before. `start`: the bytes already laid out before them (a load's size: its
    pieces laid out then these give the size of all of them together, `pack`).
    """
    offsets, cursor = [], start
    for piece in pieces:
        if direct and _direct_ok(piece):
            file_offset, n = piece.span()
            head = file_offset % DIRECT_ALIGN
            start = round_up(cursor, DIRECT_ALIGN)
            offsets.append(start + head - head % ALIGN)
            cursor = start + round_up(head + n, DIRECT_ALIGN)
        else:
            start = round_up(cursor, ALIGN)
            offsets.append(start)
            cursor = start + piece.nbytes
    return offsets, round_up(cursor, ALIGN)


def slot_size(parts: list[Part] | tuple[Part, ...], direct: bool) -> int:
    return layout([p for part in parts for p in part.pieces], direct)[1]


def pack(
    parts: Iterable[Part],
    max_bytes: int,
    direct: bool,
    first: list[Part] | None = None,
    joins: Callable[[Part, Part], bool] = lambda last, part: True,
) -> list[list[Part]] | None:
    """`parts`, whole and in order, into loads of at most `max_bytes`, after `first` (a load
    to go on filling); a part joins the last load where `joins(that load's last part, part)`.
    None where a part alone does not fit. Each load's size grows as `layout` places the
    pieces, so packing a layer's hundreds of experts is linear in them."""
    loads = [list(first)] if first else []
    size = slot_size(first, direct) if first else 0
    for part in parts:
        grown = layout(list(part.pieces), direct, size)[1]
        if loads and grown <= max_bytes and joins(loads[-1][-1], part):
            loads[-1].append(part)
            size = grown
        elif (alone := slot_size([part], direct)) <= max_bytes:
            loads.append([part])
            size = alone
        else:
            return None
    return loads


def dequantized_sizes(index: ModelIndex, part: Part, itemsize: int) -> list[int]:
    """Bytes of each of a part's quantized matrices once dequantized to the compute dtype."""
    sizes = []
    for piece in part.pieces:
        quant = index.quant(part.layer, piece.key.removesuffix(".weight"))
        if quant is not None and piece.key.endswith(".weight"):
            *lead, words = piece.shape  # stacked experts: one expert's, used in turn; a
            rows = lead[-1] if part.op == "experts" else math.prod(lead)  # per-head one: all
            sizes.append(round_up(rows * words * 32 // quant.bits * itemsize, ALIGN))
    return sizes


def dequantized_bytes(index: ModelIndex, part: Part, itemsize: int) -> int:
    """Scratch that holds all of a part's quantized matrices dequantized at once."""
    return sum(dequantized_sizes(index, part, itemsize))


ResidentForm = Literal["packed", "dequantized", "partly"]


def resident_floats(
    index: ModelIndex, loads: Sequence[Load], spare: int, itemsize: int
) -> tuple[frozenset[int], int]:
    """The resident loads of a quantized model kept dequantized (each matrix once, at warm-up,
    into memory of its own beside the packed load: no pass dequantizes it again), and the
    device bytes that costs beyond the plan's pool and scratch, within `spare` (the budget
    less pool, scratch and activation reserve). Largest savings first: loads every pass
    dequantizes whole before routed ones (a pass dequantizes only the experts its tokens
    chose), each kind largest first; the rest stay packed (dequantized into the scratch
    every pass, as streamed loads are). Issue 48: all or nothing before, so a 70B 4-bit on a
    4090 dequantized all 80 resident layers every pass."""
    if not index.quantized:
        return frozenset(), 0
    needs = [
        (load, sum(dequantized_bytes(index, part, itemsize) for part in load.parts))
        for load in loads
        if load.resident
    ]
    chosen, total = [], 0
    for load, need in sorted(needs, key=lambda ln: (ln[0].routed, -ln[1])):
        if 0 < need <= spare - total:
            chosen.append(load.seq)
            total += need
    return frozenset(chosen), total


def resident_form(
    index: ModelIndex, loads: Sequence[Load], spare: int, itemsize: int
) -> tuple[ResidentForm, int]:
    """How a quantized model's resident layers are kept (`resident_floats`): "dequantized"
    (all of them), "partly", or "packed" (none: a float model's, trivially), and the bytes."""
    seqs, nbytes = resident_floats(index, loads, spare, itemsize)
    quantized = {
        load.seq
        for load in loads
        if load.resident and any(dequantized_bytes(index, p, itemsize) for p in load.parts)
    }
    if not seqs:
        return "packed", 0
    return ("dequantized" if seqs == quantized else "partly"), nbytes
