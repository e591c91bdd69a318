"""The scratch a quantized model's plan dequantizes into, and the room for the temporaries
`dequantize` needs beside a matrix, so that no pass allocates them."""

from __future__ import annotations

import math

from tandem.nodes.model.index import ModelIndex
from tandem.nodes.prefill.dtypes import TORCH_DTYPES
from tandem.nodes.prefill.kernels.dequant import BLOCK_BYTES, temp_bytes_per_row
from tandem.nodes.prefill.planning.loads import (
    ALIGN,
    Part,
    dequantized_bytes,
    dequantized_sizes,
    round_up,
)


def scratch_bytes(
    index: ModelIndex,
    groups: list[list[list[Part]]],
    itemsize: int,
    whole_parts: bool = True,
    temp_rows: int | None = None,
) -> int:
    """Bytes to dequantize into (0 for a float model): every matrix of the largest part at
    once, and a load's experts one matrix of each at once (`experts.py`: a few kernels
    whatever the number chosen); or (`whole_parts=False`) only the largest matrix, one at a
    time, its temporaries `temp_rows` rows at a time (None: all of them, as `temp_room`)."""
    parts = [part for layer in groups for g in layer for part in g]
    if whole_parts:
        most = max((dequantized_bytes(index, p, itemsize) for p in parts), default=0)
        for g in (g for layer in groups for g in layer):
            experts = [p for p in g if p.op == "experts"]
            sizes = [s for p in experts for s in dequantized_sizes(index, p, itemsize)]
            if sizes:  # each expert's largest matrix and its temporaries, side by side
                most = max(most, len(experts) * (max(sizes) + temp_room(index, experts[:1])))
    else:
        # o_proj's and down_proj's rows are dequantized in blocks of what the scratch holds
        # (engine): they need one row, and get the room the other parts' matrices need anyway
        sizes = [
            s if p.op not in ("o", "down") else s // (p.hi - p.lo)
            for p in parts
            for s in dequantized_sizes(index, p, itemsize)
        ]
        most = max(sizes, default=0)
    return most + temp_room(index, parts, whole_parts, temp_rows) if most else 0


TIGHT_TEMP_ROWS = (256, 32, 4, 1)  # a tight budget's temporaries, rows a block: the most that fit


def temp_room(
    index: ModelIndex, parts: list[Part], whole: bool = True, rows_at_once: int | None = None
) -> int:
    """Room at the scratch's end for the temporaries `dequantize` needs beside a matrix (its
    unpacked values, widened rows), so that no pass allocates them: all of the largest
    matrix's, at most `BLOCK_BYTES` (a few blocks, a few kernels); for a tight budget
    (`whole` False) `rows_at_once` rows' of the widest (None: one), which it then goes
    through in blocks of that (a block is ~10 kernels: one row a block is launch-bound).
    Every width (2 to 8 bits) dequantizes in the room planned here."""
    dtype, room = TORCH_DTYPES[index.dtype], 0
    for part in parts:
        for piece in part.pieces:
            module = piece.key.removesuffix(".weight")
            quant = index.quant(part.layer, module)
            if quant is None or piece.key == module:
                continue
            *lead, words = piece.shape
            rows = lead[-1] if part.op == "experts" else math.prod(lead)  # MLA's per head
            stored = module.partition("@")[0]  # (a second range of one matrix: its own)
            scales = TORCH_DTYPES[index.layers[part.layer][f"{stored}.scales"].dtype]
            per_row = temp_bytes_per_row(words * 32 // quant.bits, quant.bits, scales, dtype)
            block = min(rows, rows_at_once or 1) * per_row
            room = max(room, min(per_row * rows, BLOCK_BYTES) if whole else block)
    return round_up(room, ALIGN)
