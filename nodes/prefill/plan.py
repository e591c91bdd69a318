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
from nodes.model.safetensors_format import ITEMSIZE

ALIGN = 64  # bytes; every piece starts aligned so typed views are valid
DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and memory address are multiples of this
DIRECT_MIN = 64 * 1024  # smaller pieces (norms, biases) are not worth a span of their own
MAX_RING_SLOTS = 3  # whole-layer slots
RING_LOADS = 4  # a cut layer: loads in flight, each at most a RING_LOADS-th of the ring
MIN_SLICE = 4096  # bytes: the smallest load a quantized plan tries before giving up


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

    def span(self) -> tuple[int, int]:
        """(absolute file offset, byte count) from the first byte of this piece to its last:
        `segments()`'s first start to its last end, without a list of a run per row (the
        loader asks this of every piece it reads ahead and drops)."""
        e, item = self.entry, self.entry.itemsize
        row_bytes = math.prod(e.shape[1:]) * item
        if self.cols is not None and self.cols != (0, e.shape[1]):
            c0, c1 = self.cols
            start = e.offset + c0 * item
            return start, (e.shape[0] - 1) * row_bytes + (c1 - c0) * item
        if self.rows is not None:
            r0, r1 = self.rows
            return e.offset + r0 * row_bytes, (r1 - r0) * row_bytes
        return e.offset, e.nbytes


@dataclass(frozen=True)
class Part:
    """One compute step: attention over KV heads [lo, hi) or the MLP over columns [lo, hi)."""

    layer: int
    op: Literal["attn", "mlp"]
    lo: int
    hi: int
    first: bool  # first part of this op in the layer: it computes the op's input norm
    last: bool  # last part of this op: it adds the op's summed output into the residual
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
    scratch_bytes: int = 0  # where a quantized model's parts are dequantized
    reserve_bytes: int = 0  # kept free for activations

    @property
    def device_bytes(self) -> int:
        """Everything the weights take on the device: pool plus scratch, within the budget
        less the activation reserve."""
        return self.pool_bytes + self.scratch_bytes

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


def _matrix(
    index: ModelIndex,
    i: int,
    module: str,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> list[Piece]:
    """The pieces holding rows/cols of layer i's `module` weight: the float matrix, or its
    packed words, scales and biases (a column range in values maps to words and groups)."""
    t, quant = index.layers[i], index.quant(i, module)
    if quant is None:
        return [Piece(f"{module}.weight", t[f"{module}.weight"], rows=rows, cols=cols)]
    words = groups = None
    if cols is not None:
        assert cols[0] % quant.group_size == 0 and cols[1] % quant.group_size == 0
        words = (quant.packed_cols(cols[0]), quant.packed_cols(cols[1]))
        groups = (quant.groups(cols[0]), quant.groups(cols[1]))
    return [
        Piece(f"{module}.weight", t[f"{module}.weight"], rows=rows, cols=words),
        Piece(f"{module}.scales", t[f"{module}.scales"], rows=rows, cols=groups),
        Piece(f"{module}.biases", t[f"{module}.biases"], rows=rows, cols=groups),
    ]


def _cuts_groups(index: ModelIndex, i: int, module: str, bounds: list[int]) -> bool:
    """Whether column `bounds` of layer i's `module` cut only between whole groups."""
    quant = index.quant(i, module)
    return quant is None or all(b % quant.group_size == 0 for b in bounds)


def _attn_parts(index: ModelIndex, i: int, groups: int) -> list[Part] | None:
    """Attention in `groups` KV-head groups; None where those cut o_proj's scale groups."""
    spec, t = index.spec, index.layers[i]
    rep, hd = spec.num_heads // spec.num_kv_heads, spec.head_dim
    bounds = [round(g * spec.num_kv_heads / groups) for g in range(groups + 1)]
    if not _cuts_groups(index, i, "self_attn.o_proj", [b * rep * hd for b in bounds]):
        return None
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        q_rows, kv_rows = (lo * rep * hd, hi * rep * hd), (lo * hd, hi * hd)
        pieces = [Piece("input_layernorm.weight", t["input_layernorm.weight"])] if g == 0 else []
        pieces += [
            *_matrix(index, i, "self_attn.q_proj", rows=q_rows),
            *_matrix(index, i, "self_attn.k_proj", rows=kv_rows),
            *_matrix(index, i, "self_attn.v_proj", rows=kv_rows),
            *_matrix(index, i, "self_attn.o_proj", cols=q_rows),
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
        parts.append(Part(i, "attn", lo, hi, g == 0, g == groups - 1, tuple(pieces)))
    return parts


def _mlp_parts(index: ModelIndex, i: int, groups: int) -> list[Part]:
    """The MLP in about `groups` column ranges, cut between down_proj's scale groups."""
    t, inter = index.layers[i], index.spec.intermediate_size
    quant = index.quant(i, "mlp.down_proj")
    unit = quant.group_size if quant is not None else 1
    units = inter // unit
    bounds = sorted({round(g * units / groups) * unit for g in range(groups + 1)} | {inter})
    parts = []
    last = len(bounds) - 2
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        pieces = [Piece("post_attention_layernorm.weight", t["post_attention_layernorm.weight"])]
        pieces = pieces if g == 0 else []
        pieces += [
            *_matrix(index, i, "mlp.gate_proj", rows=(lo, hi)),
            *_matrix(index, i, "mlp.up_proj", rows=(lo, hi)),
            *_matrix(index, i, "mlp.down_proj", cols=(lo, hi)),
        ]
        parts.append(Part(i, "mlp", lo, hi, g == 0, g == last, tuple(pieces)))
    return parts


def _whole(index: ModelIndex, i: int) -> list[Part]:
    attn = _attn_parts(index, i, 1)
    assert attn is not None  # one group cuts nothing
    return attn + _mlp_parts(index, i, 1)


def dequantized_sizes(index: ModelIndex, part: Part, itemsize: int) -> list[int]:
    """Bytes of each of a part's quantized matrices once dequantized to the compute dtype."""
    sizes = []
    for piece in part.pieces:
        quant = index.quant(part.layer, piece.key.removesuffix(".weight"))
        if quant is not None and piece.key.endswith(".weight"):
            rows, words = piece.shape
            sizes.append(_round_up(rows * words * 32 // quant.bits * itemsize, ALIGN))
    return sizes


def dequantized_bytes(index: ModelIndex, part: Part, itemsize: int) -> int:
    """Scratch that holds all of a part's quantized matrices dequantized at once."""
    return sum(dequantized_sizes(index, part, itemsize))


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
    whole = _whole(index, i)
    if _size(whole, direct) <= max_bytes:
        return [whole]
    spec = index.spec
    attn = None
    for g in range(1, spec.num_kv_heads + 1):
        parts = _attn_parts(index, i, g)
        if parts is not None and all(_size([p], direct) <= max_bytes for p in parts):
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
        if len(parts) < g:  # cut at every scale group already: no finer split exists
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


def _scratch(
    index: ModelIndex, groups: list[list[list[Part]]], itemsize: int, whole_parts: bool = True
) -> int:
    """Bytes to dequantize into (0 for a float model): every matrix of the largest part at
    once, or (`whole_parts=False`) only the largest matrix, one at a time."""
    parts = [part for layer in groups for g in layer for part in g]
    if whole_parts:
        return max((dequantized_bytes(index, p, itemsize) for p in parts), default=0)
    return max((max(dequantized_sizes(index, p, itemsize), default=0) for p in parts), default=0)


def make_plan(index: ModelIndex, budget: int, direct: bool = False, reserve: int = 0) -> Plan:
    """Choose slot size, slot count and resident set for `budget` bytes of device memory, of
    which `reserve` bytes stay free for activations.

    Half the weight budget goes to the ring when the model does not fit (so a resident set
    can stay loaded across requests); the ring takes all of it when that is the only way to
    double buffer; a single slot (no overlap) is the last resort. Whole layers stream when
    two fit the ring; a layer that must be cut is cut into loads of at most a
    `RING_LOADS`-th of the ring, so loads come out of roughly equal size and several are in
    flight — with two slots, attention in one and the MLP in the other, the MLP's copy would
    wait for the previous MLP's compute. `direct` lays loads out for O_DIRECT reads
    (`_layout`).

    A quantized model's loads hold its packed bytes as stored; each part is dequantized into
    a scratch of the compute dtype, counted in the budget beside the ring and the resident
    set: room for all the part's matrices where the budget allows it, else for its largest
    matrix, each dequantized when compute reaches it. Its resident layers keep the streamed
    layers' slices (one load, several parts), so the scratch stays the size of a slice's
    matrices, not a whole MLP's.
    """
    if reserve >= budget:
        raise ModelError(
            f"budget {budget} B leaves nothing for weights after {reserve} B of activations;"
            " raise --budget or lower --max-prompt-tokens"
        )
    weights = budget - reserve
    n = index.spec.num_layers
    itemsize = ITEMSIZE[index.dtype]
    largest = max(e.nbytes for layer in index.layers for e in layer.values())
    if weights < largest:
        raise ModelError(
            f"budget {budget} B ({weights} B after {reserve} B of activations) is smaller than"
            f" the largest tensor ({largest} B); raise --budget"
        )
    whole = [[_whole(index, i)] for i in range(n)]
    layer_bytes = [_size(w[0], direct) for w in whole]
    scratch = _scratch(index, whole, itemsize)
    if sum(layer_bytes) + scratch <= weights:
        return Plan(_loads(whole, set(range(n)), direct), tuple(range(n)), 0, 0, budget, scratch)

    quantized = index.quantized
    for ring_budget, min_slots in ((weights // 2, 2), (weights, 2), (weights, 1)):
        # Slot sizes to try, largest first; the first that fits min_slots wins: a whole
        # layer if two fit, else loads of a RING_LOADS-th of the ring (then of a min_slots-th).
        # A quantized model may need smaller slices still, to leave room for their scratch.
        top = ring_budget // min_slots
        targets = [max(layer_bytes)] if max(layer_bytes) <= top else []
        targets += [ring_budget // max(min_slots, RING_LOADS), top]
        while quantized and top > MIN_SLICE:  # slices cut tensors: smaller than the largest
            top //= 2
            targets.append(top)
        for target in targets:
            groups = [_layer_groups(index, i, target, direct) for i in range(n)]
            if any(g is None for g in groups):
                continue
            slot = max(_size(g, direct) for layer in groups for g in layer)  # type: ignore[union-attr]
            scratch = _scratch(index, groups, itemsize) if quantized else 0  # type: ignore[arg-type]
            if min_slots * slot + scratch > weights:  # then one matrix at a time (see engine)
                scratch = _scratch(index, groups, itemsize, whole_parts=False)  # type: ignore[arg-type]
            if min_slots * slot + scratch > weights:
                continue
            room = min(ring_budget, weights - scratch)  # the scratch comes out of the budget
            cap = MAX_RING_SLOTS if slot >= max(layer_bytes) else 2 * RING_LOADS
            n_slots = max(min_slots, min(cap, room // slot))
            if quantized:  # resident layers keep their slices: sizes as laid out that way
                sizes = [_size([p for g in layer for p in g], direct) for layer in groups]  # type: ignore[union-attr]
            else:
                sizes = layer_bytes
            resident = _resident_set(sizes, weights - n_slots * slot - scratch)
            if not resident and ring_budget < weights:
                break  # half the budget buys no resident layer: give the ring all of it
            for i in resident:
                if quantized:  # all of its slices, in one load
                    groups[i] = [[p for g in groups[i] for p in g]]  # type: ignore[union-attr]
                else:  # whole parts: exactly the layer_bytes[i] counted above
                    groups[i] = [_whole(index, i)]
            loads = _loads(groups, resident, direct)  # type: ignore[arg-type]
            return Plan(loads, tuple(sorted(resident)), n_slots, slot, budget, scratch, reserve)
    raise ModelError(f"budget {budget} B cannot hold one slice of a layer; raise --budget")
