"""The dense transformer family: Llama, Mistral, Qwen2, Qwen3 (and every family whose layer is
theirs: RMSNorm, attention with RoPE, a SwiGLU MLP, each a residual branch).

Loads: a layer is cut by the rows of its matrices only. Attention splits into KV-head groups
(q/k/v rows) that write their heads' output, then o_proj's rows (output features) that add
their columns of the residual; the MLP into intermediate rows of gate/up that write the
activation, then down_proj's rows. Every piece is one run of its file, read straight into
the slot, and every residual value takes one rounding, as in an uncut layer. The math is
`blocks.py`'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Literal

import torch
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.families.base import Groups, Pass, PrefillFamily, Weights
from tandem.nodes.prefill.kernels.blocks import LayerState, attention_part, mlp_part, out_rows_part
from tandem.nodes.prefill.kernels.dequant import (
    DequantizedWeights,
    aligned_front,
    dequantize,
    temp_bytes_per_row,
)
from tandem.nodes.prefill.planning.loads import ALIGN, Part, Piece, round_up, slot_size
from tandem.nodes.prefill.ranks.shard import Shard


class DenseFamily(PrefillFamily):
    name = "dense"

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        return _layer_groups(index, layer, max_bytes, direct)

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        return whole_layer(index, layer)

    def shard_layer(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        return [shard_attention(index, layer, shard), shard_mlp(index, layer, shard)]

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        if part.op in ("o", "down"):
            _out_rows(p, part, weights, h, state)
            return False
        w = dequantized(p, part, weights)
        if part.op in ("attn", "qkv"):
            attention_part(
                p.spec, h, state, w, part.lo, part.hi, part.first, p.start, p.rope, p.chunk,
                with_o=part.op == "attn", reduce=p.reduce,
            )  # fmt: skip
            return part.last  # the layer's K/V are final: the MLP does not touch them
        mlp_part(p.spec, h, state, w, part.first, p.chunk, part.lo, part.hi,
                 with_down=part.op == "mlp", reduce=p.reduce)  # fmt: skip
        return False


def _out_rows(
    p: Pass, part: Part, w: dict[str, torch.Tensor], h: torch.Tensor, state: LayerState
) -> None:
    """An "o" or "down" part. A quantized matrix is dequantized a block of rows at a time,
    as many as the scratch holds (the plan sizes it for the other parts' matrices): each
    block adds its own residual columns."""
    module = "self_attn.o_proj" if part.op == "o" else "mlp.down_proj"
    weight = w[f"{module}.weight"]
    quant = p.index.quant(part.layer, module)
    if quant is None or weight.is_floating_point():  # float, or dequantized already
        out_rows_part(h, state, weight, part.lo, part.hi, part.last, p.chunk)
        return
    scales, biases = w[f"{module}.scales"], w.get(f"{module}.biases")  # none in an fp mode
    rows, cols = scales.shape[0], scales.shape[1] * quant.group_size
    row_bytes = cols * torch.finfo(p.dtype).bits // 8
    scratch = aligned_front(p.scratch, row_bytes)
    temps = temp_bytes_per_row(cols, quant.bits, scales.dtype, p.dtype)  # lent after the rows
    block = max(1, (scratch.numel() - ALIGN) // (row_bytes + temps))
    for a in range(0, rows, block):
        b = min(rows, a + block)
        used = round_up((b - a) * row_bytes, ALIGN)
        dest = scratch[: (b - a) * row_bytes].view(p.dtype).view(b - a, cols)
        wq = dequantize(weight[a:b], scales[a:b], None if biases is None else biases[a:b],
                        quant, p.dtype, dest, scratch[used:])  # fmt: skip
        last = part.last and b == rows
        out_rows_part(h, state, wq, part.lo + a, part.lo + b, last, p.chunk)


def dequantized(p: Pass, part: Part, w: dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The part's weights, each quantized matrix dequantized into the scratch on use."""
    if not p.index.quantized:
        return w
    return DequantizedWeights(w, lambda module: p.index.quant(part.layer, module), p.scratch,
                              p.dtype)  # fmt: skip


def matrix_pieces(
    index: ModelIndex, i: int, module: str, rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None, tag: str = "",
) -> list[Piece]:  # fmt: skip
    """The pieces holding rows of layer i's `module` weight: the float matrix, or its packed
    words, scales and (affine) biases (a quantized matrix's rows are whole rows of each).
    `cols`: only input features [c0, c1) (a rank's share, `ranks/shard.py`: multiples of the
    group size), as the words and groups that hold them; `tag`: the pieces' keys name the
    module `module@tag` (a second range of one matrix in one part)."""
    t, quant = index.layers[i], index.quant(i, module)
    name_of = (lambda n: f"{module}@{tag}.{n}") if tag else (lambda n: f"{module}.{n}")
    if quant is None:
        return [Piece(name_of("weight"), t[f"{module}.weight"], rows=rows, cols=cols)]
    names = ("weight", "scales", "biases") if quant.biases else ("weight", "scales")
    words = groups = None
    if cols is not None:
        if cols[0] % quant.group_size or cols[1] % quant.group_size:
            raise PrefillError(
                f"layer {i}: a rank's columns {cols} of {module} split its groups of "
                f"{quant.group_size}: serve this model on fewer devices"
            )
        words = (cols[0] * quant.bits // 32, cols[1] * quant.bits // 32)
        groups = (cols[0] // quant.group_size, cols[1] // quant.group_size)
    return [Piece(name_of(name), t[f"{module}.{name}"], rows=rows,
                  cols=words if name == "weight" else groups) for name in names]  # fmt: skip


ROW_UNIT = 64  # rows: a cut matrix's ranges start at multiples of this (even GEMM shapes,
# aligned column slices of the kept activation)


def _bounds(total: int, n: int, unit: int = 1) -> list[int]:
    """Cuts of [0, total) into about n even ranges, each starting at a multiple of `unit`
    (fewer when n > total / unit; the last one takes the remainder)."""
    return sorted({min(total, round(g * total / n / unit) * unit) for g in range(n)} | {total})


def row_unit(index: ModelIndex, i: int, module: str) -> int:
    """The rows a cut of layer i's `module` moves by: `ROW_UNIT`, or for a quantized matrix
    the least multiple of it that is also one of its groups."""
    quant = index.quant(i, module)
    return ROW_UNIT if quant is None else math.lcm(ROW_UNIT, quant.group_size)


def attn_parts(index: ModelIndex, i: int, groups: int, with_o: bool) -> list[Part]:
    """Attention in `groups` KV-head groups: one "attn" part holding o_proj too (`with_o`,
    groups == 1), else "qkv" parts."""
    bounds = _bounds(index.spec.num_kv_heads, groups)
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        pieces = qkv_pieces(index, i, lo, hi, norm=g == 0)
        if with_o:
            pieces += matrix_pieces(index, i, "self_attn.o_proj")
        last = g == len(bounds) - 2
        parts.append(Part(i, "attn" if with_o else "qkv", lo, hi, g == 0, last, tuple(pieces)))
    return parts


def qkv_pieces(index: ModelIndex, i: int, lo: int, hi: int, norm: bool) -> list[Piece]:
    """KV heads [lo, hi)'s rows of q/k/v (and their biases, the q/k norms), after the input
    norm where `norm`."""
    spec, t = index.spec, index.layers[i]
    rep, hd = spec.num_heads // spec.num_kv_heads, spec.head_dim
    q_rows, kv_rows = (lo * rep * hd, hi * rep * hd), (lo * hd, hi * hd)
    pieces = [Piece("input_layernorm.weight", t["input_layernorm.weight"])] if norm else []
    pieces += [
        *matrix_pieces(index, i, "self_attn.q_proj", rows=q_rows),
        *matrix_pieces(index, i, "self_attn.k_proj", rows=kv_rows),
        *matrix_pieces(index, i, "self_attn.v_proj", rows=kv_rows),
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
    return pieces


def mlp_parts(index: ModelIndex, i: int, groups: int, with_down: bool, unit: int = 1) -> list[Part]:
    """The MLP in `groups` intermediate row ranges (starting at multiples of `unit`): one
    "mlp" part holding down_proj (`with_down`, groups == 1), else "gate_up" parts."""
    t = index.layers[i]
    bounds = _bounds(index.spec.intermediate_size, groups, unit)
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        norm = Piece("post_attention_layernorm.weight", t["post_attention_layernorm.weight"])
        pieces = [norm] if g == 0 else []
        pieces += [
            *matrix_pieces(index, i, "mlp.gate_proj", rows=(lo, hi)),
            *matrix_pieces(index, i, "mlp.up_proj", rows=(lo, hi)),
        ]
        if with_down:
            pieces += matrix_pieces(index, i, "mlp.down_proj")
        last = g == len(bounds) - 2
        parts.append(
            Part(i, "mlp" if with_down else "gate_up", lo, hi, g == 0, last, tuple(pieces))
        )
    return parts


def out_row_parts(
    index: ModelIndex, i: int, op: Literal["o", "down"], groups: int, unit: int = 1
) -> list[Part]:
    """o_proj's or down_proj's output rows (the residual's columns) in `groups` ranges,
    starting at multiples of `unit`."""
    module = "self_attn.o_proj" if op == "o" else "mlp.down_proj"
    bounds = _bounds(index.spec.hidden_size, groups, unit)
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        pieces = tuple(matrix_pieces(index, i, module, rows=(lo, hi)))
        parts.append(Part(i, op, lo, hi, g == 0, g == len(bounds) - 2, pieces))
    return parts


def shard_attention(index: ModelIndex, i: int, shard: Shard) -> Part:
    """Rank `shard`'s attention: its KV heads' q/k/v rows and o_proj's columns for them."""
    spec, t = index.spec, index.layers[i]
    lo, hi = shard.range(spec.num_kv_heads, what="KV heads")
    width = spec.num_heads // spec.num_kv_heads * spec.head_dim  # a KV head's query features
    pieces = qkv_pieces(index, i, lo, hi, norm=True)
    pieces += matrix_pieces(index, i, "self_attn.o_proj", cols=(lo * width, hi * width))
    if "self_attn.o_proj.bias" in t:  # added once, after the sum (`attention_part`)
        pieces.append(Piece("self_attn.o_proj.bias", t["self_attn.o_proj.bias"]))
    return Part(i, "attn", lo, hi, True, True, tuple(pieces))


def shard_unit(index: ModelIndex, i: int, module: str) -> int:
    """Input features a rank's columns of layer i's `module` start at multiples of: its
    groups' (a quantized matrix), else 8."""
    quant = index.quant(i, module)
    return 8 if quant is None else quant.group_size


def shard_mlp(index: ModelIndex, i: int, shard: Shard) -> Part:
    """Rank `shard`'s MLP: its intermediate rows of gate/up and down_proj's columns."""
    t = index.layers[i]
    unit = shard_unit(index, i, "mlp.down_proj")
    lo, hi = shard.range(index.spec.intermediate_size, unit, "MLP features")
    pieces = [
        Piece("post_attention_layernorm.weight", t["post_attention_layernorm.weight"]),
        *matrix_pieces(index, i, "mlp.gate_proj", rows=(lo, hi)),
        *matrix_pieces(index, i, "mlp.up_proj", rows=(lo, hi)),
        *matrix_pieces(index, i, "mlp.down_proj", cols=(lo, hi)),
    ]
    return Part(i, "mlp", lo, hi, True, True, tuple(pieces))


def whole_layer(index: ModelIndex, i: int) -> list[Part]:
    return attn_parts(index, i, 1, with_o=True) + mlp_parts(index, i, 1, with_down=True)


def _layer_groups(
    index: ModelIndex, i: int, max_bytes: int, direct: bool
) -> list[list[Part]] | None:
    """The coarsest split of layer i whose every load fits `max_bytes`; None if none does.
    An op that fits one load stays whole; a cut one takes the fewest row ranges that fit,
    starting at multiples of `row_unit` rows where those fit."""
    whole = whole_layer(index, i)
    if slot_size(whole, direct) <= max_bytes:
        return [whole]
    spec = index.spec

    def op(
        whole: list[Part], cut: Callable[[], list[Part] | None], out: Literal["o", "down"]
    ) -> list[Part] | None:
        """The op whole if it fits, else cut: its first matrices, then its output rows."""
        if slot_size(whole, direct) <= max_bytes:
            return whole
        first = cut()
        if first is None:
            return None
        module = "self_attn.o_proj" if out == "o" else "mlp.down_proj"
        rows = _in_units(
            lambda g, u: out_row_parts(index, i, out, g, u), spec.hidden_size,
            row_unit(index, i, module), max_bytes, direct,
        )  # fmt: skip
        return first + rows if rows is not None else None

    def heads() -> list[Part] | None:
        make = lambda g: attn_parts(index, i, g, with_o=False)  # noqa: E731
        return _fewest(make, spec.num_kv_heads, max_bytes, direct)

    def gate_up() -> list[Part] | None:
        make = lambda g, u: mlp_parts(index, i, g, with_down=False, unit=u)  # noqa: E731
        unit = row_unit(index, i, "mlp.gate_proj")
        return _in_units(make, spec.intermediate_size, unit, max_bytes, direct)

    attn = op(attn_parts(index, i, 1, with_o=True), heads, "o")
    if attn is None:
        return None
    mlp = op(mlp_parts(index, i, 1, with_down=True), gate_up, "down")
    if mlp is None:
        return None
    return [[p] for p in attn + mlp]


def _fewest(
    make: Callable[[int], list[Part]], limit: int, max_bytes: int, direct: bool
) -> list[Part] | None:
    """About the fewest of up to `limit` ranges whose parts all fit; None if none do.

    From the estimate up, each try scaled by how far its largest part overshot (at least 5%
    more ranges): a few dozen tries of O(ranges) each, even for 28672 rows. An average row
    (or head) that does not fit ends it at once."""
    size = slot_size(make(1), direct)
    if size / limit > max_bytes:
        return None
    g = max(1, size // max_bytes)
    while True:
        parts = make(g)
        worst = max(slot_size([p], direct) for p in parts)
        if worst <= max_bytes:
            return parts
        if g >= limit:
            return None
        g = min(limit, max(g + 1, g * 21 // 20, math.ceil(g * worst / max_bytes)))


def _in_units(
    make: Callable[[int, int], list[Part]], total: int, unit: int, max_bytes: int, direct: bool
) -> list[Part] | None:
    """The fewest ranges of `total` rows, in multiples of `unit` rows, that fit; in single
    rows only where `unit` rows do not fit a load."""
    for u in dict.fromkeys((unit, 1)):
        parts = _fewest(lambda g, u=u: make(g, u), -(-total // u), max_bytes, direct)
        if parts is not None:
            return parts
    return None
