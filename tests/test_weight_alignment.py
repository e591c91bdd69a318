"""Every weight the blocks compute with starts at a 256-byte boundary (`loads.ALIGN`), on a
made model whose tensors sit at odd file offsets, through O_DIRECT spans and the page cache;
cut matrices move by whole units of 64 rows (of whole groups where quantized)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.quant import Quant
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.families.llama import ROW_UNIT, DenseFamily
from tandem.nodes.prefill.kernels.dequant import DequantizedWeights
from tandem.nodes.prefill.planning.loads import ALIGN, landing, moves
from tandem.nodes.prefill.planning.plan import make_plan
from tandem.nodes.prefill.stream.host import aligned_empty
from tandem.nodes.prefill.stream.reads import open_direct, read_load

from tests.conftest import MakeTiny

SHAPE = {"arch": "llama", "layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2,
         "intermediate": 640, "shards": 2}  # fmt: skip
BUDGETS = ["whole", "quarter", "cut"]


def _budget(index: ModelIndex, name: str) -> int:
    """Everything resident; a quarter of the model; matrices cut into row ranges (a third
    of a float layer; a packed layer beside its dequantized scratch)."""
    if name == "whole":
        return 10**9
    if name == "quarter":
        return sum(index.layer_bytes(i) for i in range(index.spec.num_layers)) // 4
    return index.layer_bytes(0) // (1 if index.quantized else 3)


@pytest.fixture
def views_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every weight view a part's compute is handed, as (short name, view)."""
    seen: list[tuple[str, torch.Tensor]] = []
    compute = DenseFamily.compute

    def spy(self: DenseFamily, p: Any, part: Any, weights: Any, *rest: Any) -> bool:
        seen.extend(weights.items())
        return compute(self, p, part, weights, *rest)

    monkeypatch.setattr(DenseFamily, "compute", spy)
    yield seen


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("quantize", [None, 4], ids=["float", "q4"])
def test_every_weight_view_a_layer_computes_with_is_256_aligned(
    budget: str, quantize: int | None, tiny_model: MakeTiny,
    views_seen: list[tuple[str, torch.Tensor]],
) -> None:  # fmt: skip
    model = tiny_model(**SHAPE, quantize=quantize, group_size=64)
    index = load_index(model)
    entries = [e for layer in index.layers for e in layer.values()]
    assert len({e.file for e in entries}) == (2 if quantize is None else 1)  # mlx-lm's: one
    assert sum(e.offset % ALIGN != 0 for e in entries) > len(entries) // 4  # odd offsets
    engine = PrefillEngine(model, budget=_budget(index, budget), device="cpu", chunk_tokens=16)
    try:
        assert all(ld.direct for ld in engine.plan.loads)
        assert engine.plan.cuts_ops or budget != "cut"
        if budget != "whole" and quantize is None:  # really moved: landed off their place
            assert any(
                landing(p, o, True) != o
                for ld in engine.plan.loads
                for p, o in zip(ld.pieces, ld.offsets, strict=True)
            )
        list(engine.prefill(np.arange(40).tolist()))
    finally:
        engine.close()
    floats = engine.plan.resident_form == "dequantized"  # resident scales, biases used up
    used_up = (".scales", ".biases") if floats else ()
    handed = [p for ld in engine.plan.loads for p in ld.pieces
              if not (ld.resident and p.key.endswith(used_up))]  # fmt: skip
    assert len(views_seen) >= len(handed)
    bad = [(k, v.data_ptr() % ALIGN) for k, v in views_seen if v.data_ptr() % ALIGN]
    assert not bad


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_bytes_left_where_they_landed_reach_their_place_by_the_moves(
    direct: bool, tiny_model: MakeTiny
) -> None:
    """The CUDA mover's way, on the CPU: reads not settled, then `moves` copies into another
    buffer (the device slot) put every piece, at its aligned offset, as the file holds it."""
    model = tiny_model(**SHAPE)
    index = load_index(model)
    tensors: dict[str, np.ndarray] = {}
    for f in index.files:
        tensors.update(load_file(f))
    plan = make_plan(index, _budget(index, "cut"), direct=True)
    files = [str(f) for f in index.files]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    direct_fds = open_direct(files) if direct else None
    try:
        for ld in plan.loads:
            landed = aligned_empty(ld.nbytes).fill_(0xAB)
            read_load(fds, ld, landed, direct_fds, settle=False)
            slot = torch.full((ld.nbytes,), 0xCD, dtype=torch.uint8)
            for dst, src, n in moves(ld):
                slot[dst : dst + n].copy_(landed[src : src + n])
            for piece, off in zip(ld.pieces, ld.offsets, strict=True):
                assert off % ALIGN == 0
                got = slot[off : off + piece.nbytes].numpy().view(np.float32)
                want = tensors[piece.entry.name]
                if piece.rows is not None:
                    want = want[piece.rows[0] : piece.rows[1]]
                np.testing.assert_array_equal(got.reshape(piece.shape), want)
    finally:
        for fd in [*fds.values(), *(direct_fds or {}).values()]:
            os.close(fd)


def test_a_load_that_landed_in_place_is_one_copy(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(**SHAPE))
    plan = make_plan(index, 10**9, direct=False)
    assert all(moves(ld) == [(0, 0, ld.nbytes)] for ld in plan.loads)


@pytest.mark.parametrize(("quantize", "group"), [(None, 64), (4, 128)], ids=["float", "q4-g128"])
@pytest.mark.parametrize("direct", [True, False])
def test_cut_rows_move_by_64_rows_or_whole_groups(
    quantize: int | None, group: int, direct: bool, tiny_model: MakeTiny
) -> None:
    """gate/up, o and down ranges start at multiples of 64 rows (128 where the groups are of
    128), the last one ends at the matrix's end, at budgets that cut."""
    shape = {**SHAPE, "hidden": 512, "intermediate": 1408}  # 1408 = 11 × 128
    index = load_index(tiny_model(**shape, quantize=quantize, group_size=group))
    unit = ROW_UNIT if quantize is None else 128
    totals = {"gate_up": 1408, "o": 512, "down": 512}
    cuts = 0
    # a float plan needs its largest tensor; a quantized one its packed layer, dequantized
    largest = max(e.nbytes for layer in index.layers for e in layer.values())
    base = index.layer_bytes(0) // 2 if quantize else largest
    for times in (1, 2, 3):
        plan = make_plan(index, base * times, direct=direct)
        for part in (part for ld in plan.loads for part in ld.parts):
            if part.op in totals:
                cuts += 1
                assert part.lo % unit == 0, (times, part.op, part.lo)
                assert part.hi % unit == 0 or part.hi == totals[part.op], (part.op, part.hi)
    assert cuts > 0


def _misaligned(nbytes: int) -> torch.Tensor:
    """Scratch whose first byte is 64 bytes past an ALIGN boundary (as torch's CPU allocator
    may give), with ALIGN bytes of slack."""
    raw = aligned_empty(nbytes + 2 * ALIGN)
    return raw[64 : 64 + nbytes + ALIGN]


def test_dequantized_matrices_start_at_aligned_addresses() -> None:
    """Matrices dequantized into a scratch that starts off a boundary still start on one."""
    quant = Quant(4, 32)
    rng = np.random.default_rng(0)
    views: dict[str, torch.Tensor] = {}
    for name, rows in (("a", 7), ("b", 33), ("c", 5)):
        views[f"{name}.weight"] = torch.from_numpy(rng.integers(0, 2**31, (rows, 8), np.int32))
        views[f"{name}.scales"] = torch.ones((rows, 2), dtype=torch.float16)
        views[f"{name}.biases"] = torch.zeros((rows, 2), dtype=torch.float16)
    sizes = sum(-(-r * 64 * 2 // ALIGN) * ALIGN for r in (7, 33, 5))
    w = DequantizedWeights(views, lambda m: quant, _misaligned(sizes), torch.float16)
    got = [w[f"{name}.weight"] for name in "abc"]
    assert [t.data_ptr() % ALIGN for t in got] == [0, 0, 0]
    assert all(w[f"{n}.weight"] is t for n, t in zip("abc", got, strict=True))  # all kept
