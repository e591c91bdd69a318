"""How a dense layer is cut into loads (llama, mistral, qwen2, qwen3 and every family whose
attention and MLP are named as theirs): by the rows of its matrices only. Attention splits
into KV-head groups (q/k/v rows) that write their heads' output, then o_proj's rows (output
features) that add their columns of the residual; the MLP into intermediate rows of gate/up
that write the activation, then down_proj's rows. Every piece is one run of its file.
"""

from __future__ import annotations

import itertools
from typing import Literal

from tandem.nodes.model.index import ModelIndex
from tandem.nodes.prefill.loads import ALIGN, Part, Piece, round_up


def matrix_pieces(
    index: ModelIndex, i: int, module: str, rows: tuple[int, int] | None = None
) -> list[Piece]:
    """The pieces holding rows of layer i's `module` weight: the float matrix, or its packed
    words, scales and biases (a quantized matrix's rows are whole rows of all three)."""
    t, quant = index.layers[i], index.quant(i, module)
    if quant is None:
        return [Piece(f"{module}.weight", t[f"{module}.weight"], rows=rows)]
    return [
        Piece(f"{module}.{name}", t[f"{module}.{name}"], rows=rows)
        for name in ("weight", "scales", "biases")
    ]


def _bounds(total: int, n: int) -> list[int]:
    """Cuts of [0, total) into about n even ranges (fewer when n > total)."""
    return sorted({round(g * total / n) for g in range(n + 1)})


def attn_parts(index: ModelIndex, i: int, groups: int, with_o: bool) -> list[Part]:
    """Attention in `groups` KV-head groups: one "attn" part holding o_proj too (`with_o`,
    groups == 1), else "qkv" parts."""
    spec, t = index.spec, index.layers[i]
    rep, hd = spec.num_heads // spec.num_kv_heads, spec.head_dim
    bounds = _bounds(spec.num_kv_heads, groups)
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        q_rows, kv_rows = (lo * rep * hd, hi * rep * hd), (lo * hd, hi * hd)
        pieces = [Piece("input_layernorm.weight", t["input_layernorm.weight"])] if g == 0 else []
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
        if with_o:
            pieces += matrix_pieces(index, i, "self_attn.o_proj")
        last = g == len(bounds) - 2
        parts.append(Part(i, "attn" if with_o else "qkv", lo, hi, g == 0, last, tuple(pieces)))
    return parts


def mlp_parts(index: ModelIndex, i: int, groups: int, with_down: bool) -> list[Part]:
    """The MLP in `groups` intermediate row ranges: one "mlp" part holding down_proj
    (`with_down`, groups == 1), else "gate_up" parts."""
    t = index.layers[i]
    bounds = _bounds(index.spec.intermediate_size, groups)
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


def out_row_parts(index: ModelIndex, i: int, op: Literal["o", "down"], groups: int) -> list[Part]:
    """o_proj's or down_proj's output rows (the residual's columns) in `groups` ranges."""
    module = "self_attn.o_proj" if op == "o" else "mlp.down_proj"
    bounds = _bounds(index.spec.hidden_size, groups)
    parts = []
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        pieces = tuple(matrix_pieces(index, i, module, rows=(lo, hi)))
        parts.append(Part(i, op, lo, hi, g == 0, g == len(bounds) - 2, pieces))
    return parts


def whole_layer(index: ModelIndex, i: int) -> list[Part]:
    return attn_parts(index, i, 1, with_o=True) + mlp_parts(index, i, 1, with_down=True)


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
