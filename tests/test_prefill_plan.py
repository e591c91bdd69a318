"""The streaming plan: which bytes form each load, in what order, into which slots.

Checked from the outside: reconstruct file coverage from `Piece.span()`, read loads back
with `read_load` and compare with the tensors as safetensors stores them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from safetensors.numpy import load_file
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.planning.loads import ALIGN, Load, Part, direct_span
from tandem.nodes.prefill.planning.plan import Plan, make_plan
from tandem.nodes.prefill.stream.host import aligned_empty
from tandem.nodes.prefill.stream.reads import open_direct, read_load

from tests.conftest import MakeTiny

# name → MakeModelArgs fields. "qk_split" has as many KV heads as query heads and a small MLP,
# so a few budgets split attention by head groups (each group carries the shared q/k norms).
MODELS: dict[str, dict[str, object]] = {
    "llama": {"arch": "llama", "layers": 8, "shards": 2, "rope_scaling": "llama3"},
    "qwen2": {"arch": "qwen2", "layers": 8, "shards": 2},
    "qwen3": {"arch": "qwen3", "layers": 8, "shards": 2},
    "qk_split": {"arch": "qwen3", "layers": 4, "hidden": 128, "heads": 8, "kv_heads": 8,
                 "intermediate": 32, "shards": 2},
    # projections of 256 KiB and more: big enough for O_DIRECT spans (plan.DIRECT_MIN)
    "wide": {"arch": "qwen2", "layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2,
             "intermediate": 512, "shards": 2},
}  # fmt: skip


def _layers_bytes(index: ModelIndex) -> int:
    return sum(index.layer_bytes(i) for i in range(index.spec.num_layers))


def _largest(index: ModelIndex) -> int:
    return max(e.nbytes for layer in index.layers for e in layer.values())


# budget name → bytes, as a function of the model
BUDGETS: dict[str, Callable[[ModelIndex], int]] = {
    "largest_tensor": _largest,
    "half_layer": lambda ix: ix.layer_bytes(0) // 2,
    "quarter": lambda ix: _layers_bytes(ix) // 4,
    "three_layers": lambda ix: 3 * ix.layer_bytes(0) + 1000,
    "all_but_a_byte": lambda ix: _layers_bytes(ix) - 1,
}


@pytest.fixture(scope="module")
def index_of(tiny_model: MakeTiny) -> Callable[[str], ModelIndex]:
    cache: dict[str, ModelIndex] = {}

    def get(name: str) -> ModelIndex:
        if name not in cache:
            cache[name] = load_index(tiny_model(**MODELS[name]))
        return cache[name]

    return get


def _plans() -> Iterator[tuple[str, str]]:
    for model in MODELS:
        for budget in BUDGETS:
            yield model, budget


@pytest.fixture(params=list(_plans()), ids=lambda p: f"{p[0]}-{p[1]}")
def planned(
    request: pytest.FixtureRequest, index_of: Callable[[str], ModelIndex]
) -> tuple[ModelIndex, Plan, int]:
    model, budget_name = request.param
    index = index_of(model)
    budget = BUDGETS[budget_name](index)
    return index, make_plan(index, budget), budget


def test_whole_model_fits_all_resident_no_ring(index_of: Callable[[str], ModelIndex]) -> None:
    index = index_of("llama")
    plan = make_plan(index, _layers_bytes(index))
    assert plan.n_slots == 0 and plan.slot_bytes == 0
    assert plan.resident_layers == tuple(range(index.spec.num_layers))
    assert plan.granularity == "resident"
    assert all(ld.resident and ld.first_of_layer and ld.last_of_layer for ld in plan.loads)
    assert plan.pool_bytes == _layers_bytes(index)
    # one byte less and a ring is needed
    assert make_plan(index, _layers_bytes(index) - 1).n_slots >= 1


def test_budget_below_largest_tensor_is_refused(index_of: Callable[[str], ModelIndex]) -> None:
    index = index_of("llama")
    with pytest.raises(ModelError, match="largest tensor"):
        make_plan(index, _largest(index) - 1)
    with pytest.raises(ModelError):
        make_plan(index, 1000)
    assert make_plan(index, _largest(index)).pool_bytes <= _largest(index)


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_half_a_layer_streams_slices_that_fit(
    model: str, index_of: Callable[[str], ModelIndex]
) -> None:
    index = index_of(model)
    budget = index.layer_bytes(0) // 2
    plan = make_plan(index, budget)
    assert plan.granularity == "slice"
    assert plan.resident_layers == ()
    assert plan.n_slots >= 2  # double buffered: a load streams while the previous computes
    assert all(ld.nbytes <= plan.slot_bytes for ld in plan.loads)
    assert plan.pool_bytes <= budget


def test_every_load_fits_and_pool_within_budget(planned: tuple[ModelIndex, Plan, int]) -> None:
    _, plan, budget = planned
    assert plan.pool_bytes <= budget
    assert plan.budget_bytes == budget
    for ld in plan.loads:
        if not ld.resident:
            assert ld.nbytes <= plan.slot_bytes
        ends = [off + p.nbytes for p, off in zip(ld.pieces, ld.offsets, strict=True)]
        assert all(off % ALIGN == 0 for off in ld.offsets)
        assert list(ld.offsets) == sorted(ld.offsets)
        assert all(end <= nxt for end, nxt in zip(ends, ld.offsets[1:], strict=False))
        assert ends[-1] <= ld.nbytes


# each op of a layer: a whole part, or its cut form (first part kind, then its output rows)
CUT_FORMS = {"attn": ("qkv", "o"), "mlp": ("gate_up", "down")}


def _check_op_order(spec: ModelSpec, parts: list[Part]) -> None:
    """Attention before the MLP; each op whole, or cut into consecutive ranges covering all
    of its rows: KV heads, then o_proj's output rows; intermediate rows, then down_proj's."""
    ops = [p.op for p in parts]
    n_attn = sum(op in ("attn", "qkv", "o") for op in ops)
    assert all(op in ("attn", "qkv", "o") for op in ops[:n_attn])
    full = {"attn": spec.num_kv_heads, "qkv": spec.num_kv_heads, "o": spec.hidden_size,
            "mlp": spec.intermediate_size, "gate_up": spec.intermediate_size,
            "down": spec.hidden_size}  # fmt: skip
    for whole, (head, rows) in CUT_FORMS.items():
        if whole in ops:
            assert [p.op for p in parts if p.op in (whole, head, rows)] == [whole]
            kinds = [whole]
        else:
            mine = [p.op for p in parts if p.op in (head, rows)]
            assert mine == sorted(mine, key=[head, rows].index) and set(mine) == {head, rows}
            kinds = [head, rows]
        for kind in kinds:
            ranges = [(p.lo, p.hi) for p in parts if p.op == kind]
            assert ranges[0][0] == 0 and ranges[-1][1] == full[kind]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            firsts = [p.first for p in parts if p.op == kind]
            lasts = [p.last for p in parts if p.op == kind]
            assert firsts == [True] + [False] * (len(ranges) - 1)
            assert lasts == [False] * (len(ranges) - 1) + [True]


def test_loads_in_layer_order(planned: tuple[ModelIndex, Plan, int]) -> None:
    index, plan, _ = planned
    spec = index.spec
    assert [ld.seq for ld in plan.loads] == list(range(len(plan.loads)))
    layers = [ld.layer for ld in plan.loads]
    assert layers == sorted(layers)
    assert set(layers) == set(range(spec.num_layers))
    for i in range(spec.num_layers):
        mine = [ld for ld in plan.loads if ld.layer == i]
        assert [ld.first_of_layer for ld in mine] == [True] + [False] * (len(mine) - 1)
        assert [ld.last_of_layer for ld in mine] == [False] * (len(mine) - 1) + [True]
        assert {ld.resident for ld in mine} == {i in plan.resident_layers}
        parts = [part for ld in mine for part in ld.parts]
        _check_op_order(spec, parts)
    # resident layers start at layer 0 (compute starts while the ring fills) and are spread
    # evenly, so each one lets the loader get ahead instead of idling at the start
    r, n = plan.resident_layers, spec.num_layers
    assert r == tuple(j * n // len(r) for j in range(len(r)))


SHARED_ACROSS_HEAD_GROUPS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


def test_every_layer_byte_covered_exactly_once(planned: tuple[ModelIndex, Plan, int]) -> None:
    """Rebuild per-file byte coverage from the pieces' spans.

    q/k norms act on every head, so each attention head group holds its own copy of them.
    """
    index, plan, _ = planned
    coverage = {str(f): np.zeros(os.path.getsize(f), dtype=np.int32) for f in index.files}
    for ld in plan.loads:
        for piece in ld.pieces:
            offset, n = piece.span()
            coverage[str(piece.entry.file)][offset : offset + n] += 1
            assert n == piece.nbytes
    expected_total = 0
    for i, tensors in enumerate(index.layers):
        attn_groups = sum(
            1 for ld in plan.loads for p in ld.parts if p.layer == i and p.op in ("attn", "qkv")
        )
        for key, e in tensors.items():
            want = attn_groups if key in SHARED_ACROSS_HEAD_GROUPS else 1
            counts = coverage[str(e.file)][e.offset : e.offset + e.nbytes]
            assert counts.min() == counts.max() == want, f"layer {i} {key}"
            expected_total += want * e.nbytes
    # nothing else: no header bytes, no embedding, no LM head
    assert sum(int(c.sum()) for c in coverage.values()) == expected_total


def test_qk_norms_shared_when_attention_splits(index_of: Callable[[str], ModelIndex]) -> None:
    # makes sure the coverage test above really sees attention split into head groups
    index = index_of("qk_split")
    plan = make_plan(index, index.layer_bytes(0) // 2)
    groups = [p for ld in plan.loads for p in ld.parts if p.layer == 1 and p.op == "qkv"]
    assert len(groups) > 1
    for part in groups:
        assert {p.key for p in part.pieces} >= SHARED_ACROSS_HEAD_GROUPS


@pytest.mark.parametrize("how", ["page_cache", "o_direct"])
@pytest.mark.parametrize("model", ["qwen2", "qk_split", "wide"])
@pytest.mark.parametrize("budget_name", ["largest_tensor", "half_layer", "quarter"])
def test_loads_read_back_as_tensor_slices(
    model: str, budget_name: str, how: str, index_of: Callable[[str], ModelIndex]
) -> None:
    """`read_load` at the plan's offsets yields exactly the row slices of the tensors, through
    the page cache and through O_DIRECT spans (which also write neighbouring bytes)."""
    index = index_of(model)
    direct = how != "page_cache"
    plan = make_plan(index, BUDGETS[budget_name](index), direct=direct)
    tensors: dict[str, np.ndarray] = {}
    for f in index.files:
        tensors.update(load_file(f))
    fds = {str(f): os.open(f, os.O_RDONLY) for f in index.files}
    direct_fds = open_direct([str(f) for f in index.files]) if direct else None
    spans = 0
    try:
        for ld in plan.loads:
            buf = aligned_empty(ld.nbytes).fill_(0xAB)
            assert read_load(fds, ld, buf, direct_fds) == ld.weight_bytes
            pieces = zip(ld.pieces, ld.offsets, strict=True)
            spans += sum(direct_span(p, o) is not None for p, o in pieces)
            buf = buf.numpy()
            for piece, off in zip(ld.pieces, ld.offsets, strict=True):
                got = buf[off : off + piece.nbytes].view(np.float32).reshape(piece.shape)
                want = tensors[piece.entry.name]
                if piece.rows is not None:
                    want = want[piece.rows[0] : piece.rows[1]]
                np.testing.assert_array_equal(got, want)
    finally:
        for fd in [*fds.values(), *(direct_fds or {}).values()]:
            os.close(fd)
    if direct and model == "wide":  # really read by O_DIRECT (this file system allows it)
        assert spans > 0 and direct_fds


def test_resident_layers_are_whole_and_fit_tight_budgets(
    index_of: Callable[[str], ModelIndex],
) -> None:
    """Regression: resident layers of a split plan were loaded as the split pieces (q/k norms
    repeated per head group, alignment per slice) but counted at the whole layer's size, so
    a budget exactly as large as the plan's own accounting got a pool bigger than itself."""
    index = index_of("qk_split")
    whole = [make_plan(index, 10**9).loads[i].nbytes for i in range(index.spec.num_layers)]
    largest, checked = _largest(index), 0
    for budget in range(largest, sum(whole), 4099):
        plan = make_plan(index, budget)
        assert plan.pool_bytes <= budget
        tight = plan.n_slots * plan.slot_bytes + sum(whole[i] for i in plan.resident_layers)
        if tight < largest:
            continue
        tight_plan = make_plan(index, tight)
        assert tight_plan.pool_bytes <= tight, f"budget {tight}"
        for ld in tight_plan.loads:
            if ld.resident:
                assert [p.op for p in ld.parts] == ["attn", "mlp"]
                assert ld.nbytes == whole[ld.layer]
        checked += bool(tight_plan.resident_layers) and tight_plan.granularity != "resident"
    assert checked > 10  # split plans with a resident set were really exercised


def _kinds(loads: tuple[Load, ...]) -> list[str]:
    return [f"{ld.layer}:{'+'.join(p.op for p in ld.parts)}" for ld in loads]


def test_plan_is_deterministic(index_of: Callable[[str], ModelIndex]) -> None:
    index = index_of("llama")
    budget = _layers_bytes(index) // 4
    a, b = make_plan(index, budget), make_plan(index, budget)
    assert a == b
    assert _kinds(a.loads)[0] == "0:attn+mlp"  # the resident layer 0 is one load


def test_resident_set_spreads_evenly_and_fits() -> None:
    from tandem.nodes.prefill.planning.plan import _resident_set

    assert _resident_set([10] * 16, 25) == {0, 8}
    assert _resident_set([10] * 16, 40) == {0, 4, 8, 12}
    assert _resident_set([10] * 16, 9) == set()
    assert _resident_set([10] * 4, 1000) == {0, 1, 2}  # never every layer: one streams
    # uneven sizes: an even spread that does not fit gives way to a smaller one
    assert _resident_set([10, 10, 30, 10], 30) == {0}


@pytest.mark.parametrize("model", ["qwen2", "qk_split", "wide"])
@pytest.mark.parametrize("budget_name", ["largest_tensor", "half_layer", "quarter"])
def test_every_piece_is_one_run_of_rows(
    model: str, budget_name: str, index_of: Callable[[str], ModelIndex]
) -> None:
    """Cut ops are cut by rows only: every piece is whole rows of its tensor, one run of the
    file, and a cut matrix's row ranges tile it."""
    index = index_of(model)
    plan = make_plan(index, BUDGETS[budget_name](index), direct=True)
    rows: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for ld in plan.loads:
        for piece in ld.pieces:
            e = piece.entry
            lo, hi = piece.rows or (0, e.shape[0])
            row = e.nbytes // e.shape[0]
            assert piece.span() == (e.offset + lo * row, (hi - lo) * row)
            rows.setdefault((ld.layer, piece.key), []).append((lo, hi))
    cut = 0
    for (_, key), ranges in rows.items():
        if key.endswith(("q_norm.weight", "k_norm.weight")):
            continue  # every head group holds its own copy
        ranges.sort()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), key
        cut += len(ranges) > 1 and key.endswith(("o_proj.weight", "down_proj.weight"))
    if budget_name == "largest_tensor":
        assert cut  # o_proj and down_proj really were cut by their rows
