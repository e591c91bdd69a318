"""The prefill cost model's ring simulator on hand-made loads, its break-even, per-slice work."""

from __future__ import annotations

import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.planning import cost
from tandem.nodes.prefill.planning.plan import Plan

# --- the ring simulator on hand-made loads ------------------------------------------------


def ring(n: int, read: float, compute: float, copy: float = 0.0) -> list[cost.Step]:
    return [cost.Step(read, copy, compute, streamed=True) for _ in range(n)]


def test_copy_bound_ring_hides_all_compute_but_the_last() -> None:
    assert cost.simulate(ring(10, read=1.0, compute=0.1), n_slots=2) == pytest.approx(10.1)
    cuda = ring(10, read=0.2, compute=0.1, copy=1.0)  # PCIe-bound: reads hide behind copies
    assert cost.simulate(cuda, n_slots=3, staging=2) == pytest.approx(0.2 + 10 + 0.1)


def test_compute_bound_ring_hides_all_reads_but_the_first() -> None:
    assert cost.simulate(ring(10, read=0.1, compute=1.0), n_slots=3) == pytest.approx(10.1)
    cuda = ring(10, read=0.05, compute=1.0, copy=0.05)
    assert cost.simulate(cuda, n_slots=2, staging=2) == pytest.approx(0.1 + 10)


def test_one_slot_ring_is_sequential() -> None:
    assert cost.simulate(ring(5, read=1.0, compute=2.0), n_slots=1) == pytest.approx(15)
    cuda = ring(5, read=1.0, compute=2.0, copy=0.5)
    assert cost.simulate(cuda, n_slots=1, staging=2) == pytest.approx(5 * 2.0 + 1.5 + 4 * 0.5)


def test_balanced_ring_overlaps_and_resident_loads_cost_no_read() -> None:
    assert cost.simulate(ring(10, read=1.0, compute=1.0), n_slots=2) == pytest.approx(11)
    warm = [cost.Step(9.0, 9.0, 1.0, streamed=False) for _ in range(4)]
    assert cost.simulate(warm, n_slots=0) == pytest.approx(4)
    # a resident layer between streamed ones gives the loader a step ahead
    mixed = [*ring(2, 1.0, 0.5), warm[0], *ring(2, 1.0, 0.5)]
    assert cost.simulate(mixed, n_slots=2) == pytest.approx(4.5)


def test_break_even_is_the_first_prompt_remote_wins() -> None:
    remote = lambda n: 5 + n / 1000  # noqa: E731  a floor, then fast
    local = lambda n: n / 100  # noqa: E731
    n = cost.break_even_tokens(remote, local, 1 << 17)
    assert n == 556 and remote(n) < local(n) and remote(n - 1) >= local(n - 1)
    assert cost.break_even_tokens(lambda n: 1 + n, lambda n: n, 1 << 17) is None
    assert cost.break_even_tokens(lambda n: 0.0, local, 100) == 1


def test_work_of_slices_adds_up_to_whole_layers(tiny_model) -> None:
    index = load_index(tiny_model(arch="llama", layers=4, hidden=256, heads=4, kv_heads=2,
                                  intermediate=512))  # fmt: skip
    layers = sum(index.layer_bytes(i) for i in range(4))
    whole, sliced = (
        cost.node_plan(index, 2 * layers),
        cost.node_plan(index, layers // 6),
    )
    assert whole.granularity == "resident" and sliced.granularity == "slice"
    tokens, spec = 300, index.spec

    def total(plan: Plan) -> cost.Work:
        return sum(
            (cost.load_work(spec, ld, tokens, 0, "cuda", 4) for ld in plan.loads), cost.Work()
        )

    params = sum(e.nbytes // 4 for i in range(4) for k, e in index.layers[i].items()
                 if k.endswith("proj.weight"))  # fmt: skip
    assert total(whole).matmul == total(sliced).matmul == 2 * tokens * params
    pairs = tokens * (tokens + 1) // 2  # causal
    assert total(whole).attention == total(sliced).attention == 4 * 64 * 4 * pairs * 4
