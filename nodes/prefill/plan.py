"""How a model's weights flow through a fixed budget: which bytes form each load, in what order,
into which slots, and which layers stay resident.

A *load* is what one slot holds at a time: a whole layer, or one part of it (attention or
MLP), or a slice of a part when even parts do not fit. Slices split attention by KV-head
groups (q/k/v rows, o columns) and the MLP by intermediate columns (gate/up rows, down
columns), so each slice computes independently and adds into the residual stream.

The access is cyclic (layer 0..L-1, then again), so the policy is a ring of slots fed in order
plus a fixed resident set — never LRU, which evicts exactly the layer needed next.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

from nodes.model.errors import ModelError
from nodes.model.index import ModelIndex, TensorEntry

ALIGN = 64  # bytes; every piece starts aligned so typed views are valid
DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and memory address are multiples of this
DIRECT_MIN = 64 * 1024  # smaller pieces (norms, biases) are not worth a span of their own
MAX_RING_SLOTS = 3


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Piece:
    """A tensor, or a row or column range of a 2-D tensor, as it lands in slot memory."""

    key: str  # short name, e.g. "self_attn.q_proj.weight"
    entry: TensorEntry
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.entry.shape)
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        if self.cols is not None:
            shape[1] = self.cols[1] - self.cols[0]
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.entry.itemsize

    def segments(self) -> list[tuple[int, int]]:
        """(absolute file offset, byte count) runs that make up this piece, in order."""
        e, item = self.entry, self.entry.itemsize
        row_bytes = math.prod(e.shape[1:]) * item
        if self.cols is not None and self.cols != (0, e.shape[1]):
            c0, c1 = self.cols  # one run per row: [rows, c0:c1] of a row-major matrix
            return [
                (e.offset + r * row_bytes + c0 * item, (c1 - c0) * item) for r in range(e.shape[0])
            ]
        if self.rows is not None:
            r0, r1 = self.rows
            return [(e.offset + r0 * row_bytes, (r1 - r0) * row_bytes)]
        return [(e.offset, e.nbytes)]


@dataclass(frozen=True)
class Part:
    """One compute step: attention over KV heads [lo, hi) or the MLP over columns [lo, hi)."""

    layer: int
    op: Literal["attn", "mlp"]
    lo: int
    hi: int
    first: bool  # first part of this op in the layer: it computes the op's input norm
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
    direct: bool = False  # laid out for O_DIRECT reads (see `_layout`)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for part in self.parts for p in part.pieces)

    @property
    def weight_bytes(self) -> int:
        """The tensor bytes in this load (`nbytes` adds alignment padding)."""
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class Plan:
    loads: tuple[Load, ...]
    resident_layers: tuple[int, ...]
    n_slots: int
    slot_bytes: int
    budget_bytes: int

    @property
    def resident_bytes(self) -> int:
        return sum(ld.nbytes for ld in self.loads if ld.resident)

    @property
    def pool_bytes(self) -> int:
        """Device memory reserved for weights: the ring plus the resident set."""
        return self.n_slots * self.slot_bytes + self.resident_bytes

    @property
    def granularity(self) -> str:
        streamed = [ld for ld in self.loads if not ld.resident]
        if not streamed:
            return "resident"
        n = max(sum(1 for ld in streamed if ld.layer == i) for i in {ld.layer for ld in streamed})
        return {1: "layer", 2: "part"}.get(n, "slice")


def _attn_parts(index: ModelIndex, i: int, groups: int) -> list[Part]:
    spec, t = index.spec, index.layers[i]
    rep, hd = spec.num_heads // spec.num_kv_heads, spec.head_dim
    bounds = [round(g * spec.num_kv_heads / groups) for g in range(groups + 1)]
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        q_rows, kv_rows = (lo * rep * hd, hi * rep * hd), (lo * hd, hi * hd)
        pieces = [Piece("input_layernorm.weight", t["input_layernorm.weight"])] if g == 0 else []
        pieces += [
            Piece("self_attn.q_proj.weight", t["self_attn.q_proj.weight"], rows=q_rows),
            Piece("self_attn.k_proj.weight", t["self_attn.k_proj.weight"], rows=kv_rows),
            Piece("self_attn.v_proj.weight", t["self_attn.v_proj.weight"], rows=kv_rows),
            Piece("self_attn.o_proj.weight", t["self_attn.o_proj.weight"], cols=q_rows),
        ]
        if spec.attention_bias:
            pieces += [
                Piece("self_attn.q_proj.bias", t["self_attn.q_proj.bias"], rows=q_rows),
                Piece("self_attn.k_proj.bias", t["self_attn.k_proj.bias"], rows=kv_rows),
                Piece("self_attn.v_proj.bias", t["self_attn.v_proj.bias"], rows=kv_rows),
            ]
        if spec.qk_norm:
            pieces += [
                Piece("self_attn.q_norm.weight", t["self_attn.q_norm.weight"]),
                Piece("self_attn.k_norm.weight", t["self_attn.k_norm.weight"]),
            ]
        parts.append(Part(i, "attn", lo, hi, g == 0, tuple(pieces)))
    return parts


def _mlp_parts(index: ModelIndex, i: int, groups: int) -> list[Part]:
    t, inter = index.layers[i], index.spec.intermediate_size
    bounds = [round(g * inter / groups) for g in range(groups + 1)]
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        pieces = [Piece("post_attention_layernorm.weight", t["post_attention_layernorm.weight"])]
        pieces = pieces if g == 0 else []
        pieces += [
            Piece("mlp.gate_proj.weight", t["mlp.gate_proj.weight"], rows=(lo, hi)),
            Piece("mlp.up_proj.weight", t["mlp.up_proj.weight"], rows=(lo, hi)),
            Piece("mlp.down_proj.weight", t["mlp.down_proj.weight"], cols=(lo, hi)),
        ]
        parts.append(Part(i, "mlp", lo, hi, g == 0, tuple(pieces)))
    return parts


def _direct_ok(piece: Piece) -> bool:
    """Whether a direct layout gives `piece` an O_DIRECT span of its own."""
    segments = piece.segments()
    return (
        len(segments) == 1
        and piece.nbytes >= DIRECT_MIN
        and segments[0][0] % piece.entry.itemsize == 0  # typed views stay valid
    )


def direct_span(piece: Piece, offset: int) -> tuple[int, int, int] | None:
    """(file offset, slot offset, length) of the aligned O_DIRECT read that lands `piece` at
    `offset` in a `DIRECT_ALIGN`-aligned slot of a `direct` load, or None."""
    if not _direct_ok(piece):
        return None
    file_offset, n = piece.segments()[0]
    head = file_offset % DIRECT_ALIGN
    if (offset - head) % DIRECT_ALIGN:
        return None
    return file_offset - head, offset - head, _round_up(head + n, DIRECT_ALIGN)


def _layout(pieces: list[Piece], direct: bool) -> tuple[list[int], int]:
    """Each piece's offset in slot memory, and the bytes the slot needs.

    Pieces start `ALIGN`-aligned. With `direct`, a piece that is one run of the file sits at
    its file offset modulo `DIRECT_ALIGN`, inside a span of whole aligned blocks of its own:
    the disk then DMAs it straight into the slot (O_DIRECT), no copy through the page cache,
    which on a CPU prefill is CPU time taken from compute. Under 8 KiB per piece of at least
    `DIRECT_MIN` bytes; smaller ones are read as before.
    """
    offsets, cursor = [], 0
    for piece in pieces:
        if direct and _direct_ok(piece):
            file_offset, n = piece.segments()[0]
            head = file_offset % DIRECT_ALIGN
            start = _round_up(cursor, DIRECT_ALIGN)
            offsets.append(start + head)
            cursor = start + _round_up(head + n, DIRECT_ALIGN)
        else:
            start = _round_up(cursor, ALIGN)
            offsets.append(start)
            cursor = start + piece.nbytes
    return offsets, _round_up(cursor, ALIGN)


def _size(parts: list[Part] | tuple[Part, ...], direct: bool) -> int:
    return _layout([p for part in parts for p in part.pieces], direct)[1]


def _layer_groups(
    index: ModelIndex, i: int, max_bytes: int, direct: bool
) -> list[list[Part]] | None:
    """The coarsest split of layer i whose every load fits `max_bytes`; None if none does."""
    whole = _attn_parts(index, i, 1) + _mlp_parts(index, i, 1)
    if _size(whole, direct) <= max_bytes:
        return [whole]
    spec = index.spec
    attn = None
    for g in range(1, spec.num_kv_heads + 1):
        parts = _attn_parts(index, i, g)
        if all(_size([p], direct) <= max_bytes for p in parts):
            attn = parts
            break
    if attn is None:
        return None
    mlp_bytes = _size(_mlp_parts(index, i, 1), direct)
    mlp = None
    for g in range(max(1, mlp_bytes // max_bytes), spec.intermediate_size + 1):
        parts = _mlp_parts(index, i, g)
        if all(_size([p], direct) <= max_bytes for p in parts):
            mlp = parts
            break
    if mlp is None:
        return None
    return [[p] for p in attn] + [[p] for p in mlp]


def _loads(
    groups_per_layer: list[list[list[Part]]], resident: set[int], direct: bool
) -> tuple[Load, ...]:
    loads: list[Load] = []
    for i, groups in enumerate(groups_per_layer):
        if i in resident:  # a resident layer is one load into its own region
            groups = [[part for g in groups for part in g]]
        for j, parts in enumerate(groups):
            offsets, size = _layout([p for part in parts for p in part.pieces], direct)
            loads.append(
                Load(
                    seq=len(loads),
                    layer=i,
                    parts=tuple(parts),
                    offsets=tuple(offsets),
                    nbytes=size,
                    first_of_layer=j == 0,
                    last_of_layer=j == len(groups) - 1,
                    resident=i in resident,
                    direct=direct,
                )
            )
    return tuple(loads)


def _resident_set(layer_bytes: list[int], room: int) -> set[int]:
    """As many whole layers as fit in `room` bytes (never all), spread evenly from layer 0.

    Layer 0 lets compute start while the ring fills; each later one hands compute a layer that
    needs no load, so the loader gets ahead of a two-slot ring. All of them at the front
    would instead leave the loader idle, its ring full, while compute works through them.
    """
    n, count, used = len(layer_bytes), 0, 0
    for size in sorted(layer_bytes):
        if used + size > room or count >= n - 1:
            break
        used, count = used + size, count + 1
    while count:
        spread = {j * n // count for j in range(count)}
        if sum(layer_bytes[i] for i in spread) <= room:
            return spread
        count -= 1  # uneven layer sizes: fewer, until an even spread fits
    return set()


def make_plan(index: ModelIndex, budget: int, direct: bool = False) -> Plan:
    """Choose slot size, slot count and resident set for `budget` bytes of weight memory.

    Half the budget goes to the ring when the model does not fit (so a resident set can stay
    loaded across requests); the ring takes all of it when that is the only way to double
    buffer; a single slot (no overlap) is the last resort. `direct` lays loads out for
    O_DIRECT reads (`_layout`).
    """
    n = index.spec.num_layers
    largest = max(e.nbytes for layer in index.layers for e in layer.values())
    if budget < largest:
        raise ModelError(
            f"budget {budget} B is smaller than the largest tensor ({largest} B); raise --budget"
        )
    layer_bytes = [
        _size(_attn_parts(index, i, 1) + _mlp_parts(index, i, 1), direct) for i in range(n)
    ]
    if sum(layer_bytes) <= budget:
        whole = [[_attn_parts(index, i, 1) + _mlp_parts(index, i, 1)] for i in range(n)]
        loads = _loads(whole, set(range(n)), direct)
        return Plan(loads, tuple(range(n)), 0, 0, budget)

    for ring_budget, min_slots in ((budget // 2, 2), (budget, 2), (budget, 1)):
        # Try slot sizes from a whole layer down; the first that fits min_slots wins.
        for target in sorted({max(layer_bytes), ring_budget // min_slots}, reverse=True):
            target = min(target, ring_budget // min_slots)
            groups = [_layer_groups(index, i, target, direct) for i in range(n)]
            if any(g is None for g in groups):
                continue
            slot = max(_size(g, direct) for layer in groups for g in layer)  # type: ignore[union-attr]
            n_slots = max(min_slots, min(MAX_RING_SLOTS, ring_budget // slot))
            resident = _resident_set(layer_bytes, budget - n_slots * slot)
            if not resident and ring_budget < budget:
                break  # half the budget buys no resident layer: give the ring all of it
            for i in resident:  # whole parts: exactly the layer_bytes[i] counted above
                groups[i] = [_attn_parts(index, i, 1) + _mlp_parts(index, i, 1)]
            loads = _loads(groups, resident, direct)  # type: ignore[arg-type]
            return Plan(loads, tuple(sorted(resident)), n_slots, slot, budget)
    raise ModelError(f"budget {budget} B cannot hold one slice of a layer; raise --budget")
