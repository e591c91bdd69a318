"""The prefill streamer's guarantees, on CPU: the resident set streamed once, layer and link
events, loads that overlap compute, identical K/V under slow movers or compute, O_DIRECT reads."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem.nodes.contract.events import Event, LayerEvent, LinkEvent
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.families import llama as dense_family
from tandem.nodes.prefill.planning.loads import Load
from tandem.nodes.prefill.planning.plan import make_plan
from tandem.nodes.prefill.stream.movers import CpuMover, FillTimes

from tests.conftest import MakeTiny
from tests.records import listen
from tests.test_prefill_engine import BUDGETS, LAYERS, half_layer, prompt, quarter, run
from tests.test_prefill_engine import llama_dir as llama_dir  # a fixture
from tests.test_prefill_engine import open_engine as open_engine  # a fixture

# ---------------------------------------------------------------- the resident set


def direct_files(engine: PrefillEngine) -> set[str]:
    """The files its reader still reads with O_DIRECT (not refused)."""
    return {f for f in engine.streamer.mover._reader.direct if not f.startswith("refused:")}


def test_resident_layers_are_streamed_once(
    llama_dir: Path, open_engine: Callable[..., PrefillEngine]
) -> None:
    index = load_index(llama_dir)
    engine = open_engine(llama_dir, budget=quarter(index))
    plan = engine.plan
    assert plan.resident_layers and plan.n_slots >= 2
    tokens = prompt(120)
    first = run(engine, tokens)
    s1 = engine.last_stats
    second = run(engine, tokens)
    s2 = engine.last_stats
    assert s1.resident_layers == s2.resident_layers == list(plan.resident_layers)
    assert s1.bytes_streamed == sum(index.layer_bytes(i) for i in range(LAYERS))  # each once
    assert s1.bytes_streamed - s2.bytes_streamed == plan.resident_bytes > 0
    for a, b in zip(first, second, strict=True):  # the resident weights were kept intact
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


# ---------------------------------------------------------------- events and overlap


def collect(engine: PrefillEngine) -> list[Event]:
    events: list[Event] = []
    listen(engine.events, events.append)
    return events


def layer_events(events: list[Event], rid: str) -> list[LayerEvent]:
    return [e for e in events if isinstance(e, LayerEvent) and e.request_id == rid]


def test_layer_and_link_events(llama_dir: Path, open_engine: Callable[..., PrefillEngine]) -> None:
    engine = open_engine(llama_dir, budget=quarter(load_index(llama_dir)))
    plan = engine.plan
    events = collect(engine)
    run(engine, prompt(100), request_id="req-1")
    stats = engine.last_stats
    mine = layer_events(events, "req-1")
    for i in range(LAYERS):
        states = [e.state for e in mine if e.layer == i]
        loads = [ld for ld in plan.loads if ld.layer == i]
        resident = i in plan.resident_layers
        firsts = [states.index(s) for s in ("queued", "loading", "ready", "computing")]
        assert firsts == sorted(firsts), (i, states)
        assert states.count("queued") == states.count("computing") == 1
        loader = [s for s in states if s in ("loading", "ready")]
        assert loader == ["loading", "ready"] * len(loads), (i, states)
        if resident:
            assert "evicted" not in states
        else:
            assert states.count("evicted") == len(loads)
            assert states.index("evicted") > states.index("computing")
            last_ready = len(states) - 1 - states[::-1].index("ready")
            assert states[-1] == "evicted" and len(states) - 1 > last_ready
        assert all(e.pinned == resident for e in mine if e.layer == i)
    ready = [e for e in mine if e.state == "ready"]
    assert sum(e.bytes for e in ready) == stats.bytes_streamed
    links = [e for e in events if isinstance(e, LinkEvent) and e.request_id == "req-1"]
    for name in ("disk", "h2d"):
        moved = [e for e in links if e.name == name]
        assert len(moved) == len(plan.loads)
        assert sum(e.bytes for e in moved) == stats.bytes_streamed
        assert all(e.seconds >= 0 for e in moved)
    # a second request finds the resident layers loaded: no loader events for them
    run(engine, prompt(100), request_id="req-2")
    again = layer_events(events, "req-2")
    for i in plan.resident_layers:
        assert [e.state for e in again if e.layer == i] == ["queued", "computing"]
    links2 = [e for e in events if isinstance(e, LinkEvent) and e.request_id == "req-2"]
    streamed = sum(e.bytes for e in links2 if e.name == "h2d")
    assert streamed == engine.last_stats.bytes_streamed


def overlaps(events: list[LayerEvent], streamed_layers: list[int]) -> tuple[int, int]:
    """(pairs where layer i+1 started loading before layer i's compute ended, pairs checked)."""
    hits = pairs = 0
    for i in streamed_layers:
        if i + 1 not in streamed_layers:
            continue
        pairs += 1
        loading_next = next(
            k for k, e in enumerate(events) if e.layer == i + 1 and e.state == "loading"
        )
        done = max(k for k, e in enumerate(events) if e.layer == i and e.state == "evicted")
        hits += loading_next < done
    return hits, pairs


@pytest.mark.serial  # the loader thread must get a core while compute runs: not beside a worker
@pytest.mark.parametrize("layers_in_budget", [4, 2])
def test_loads_overlap_compute(
    layers_in_budget: int, llama_dir: Path, open_engine: Callable[..., PrefillEngine]
) -> None:
    """While layer i computes, layer i+1 is already loading over the (emulated) link.

    A long prompt keeps compute per load (~several ms) above the throttled load time (~2 ms
    per full slot), so the loader is ahead and the ordering of the events is not a photo
    finish. Synchronous mode is the control: the same check finds no overlap there.
    """
    index = load_index(llama_dir)
    budget = layers_in_budget * index.layer_bytes(0) + 1000
    plan = make_plan(index, budget, direct=True)  # a CPU engine reads with O_DIRECT
    rate = plan.slot_bytes / 0.002  # bytes/s
    engine = open_engine(llama_dir, budget=budget, link_gbps=rate * 8 / 1e9, chunk_tokens=64)
    assert engine.plan == plan
    assert plan.granularity == ("layer" if layers_in_budget == 4 else "slice")
    streamed = sorted({ld.layer for ld in plan.loads if not ld.resident})
    events = collect(engine)
    tokens = prompt(600)
    overlapped = run(engine, tokens, request_id="overlap")
    # the link really was slow: every load waited out its bytes at the emulated rate
    streamed_bytes = sum(ld.nbytes for ld in plan.loads)
    assert engine.last_stats.load_busy_s >= 0.99 * streamed_bytes / rate
    hits, pairs = overlaps(layer_events(events, "overlap"), streamed)
    assert pairs >= 4
    assert hits >= pairs - 1, f"only {hits} of {pairs} layers loaded during compute"
    sync = run(engine, tokens, request_id="sync", synchronous=True)
    assert overlaps(layer_events(events, "sync"), streamed) == (0, pairs)
    for a, b in zip(overlapped, sync, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


class SlowMover(CpuMover):
    """A mover that takes a random few ms per load, before and after reading."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rng = random.Random(7)

    def fill(self, slot: int, region: torch.Tensor, load: Load) -> FillTimes:
        time.sleep(self._rng.uniform(0, 0.004))
        times = super().fill(slot, region, load)
        time.sleep(self._rng.uniform(0, 0.002))
        return times


def slow_mover(files: list[str], device: torch.device, link_gbps: float | None) -> SlowMover:
    return SlowMover(files, link_gbps, device)


@pytest.mark.parametrize("budget_name", list(BUDGETS))
def test_slow_mover_gives_identical_kv(
    budget_name: str, llama_dir: Path, open_engine: Callable[..., PrefillEngine]
) -> None:
    budget = BUDGETS[budget_name](load_index(llama_dir))
    tokens = prompt(150)
    fast = run(open_engine(llama_dir, budget=budget), tokens)
    slow_engine = open_engine(llama_dir, budget=budget, mover=slow_mover)
    assert isinstance(slow_engine.streamer.mover, SlowMover)
    for _ in range(2):  # the second pass reuses the resident set
        slow = run(slow_engine, tokens)
        for a, b in zip(fast, slow, strict=True):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("budget_name", list(BUDGETS))
def test_slow_compute_gives_identical_kv(
    budget_name: str,
    llama_dir: Path,
    open_engine: Callable[..., PrefillEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fast loader must never overwrite a slot whose compute has not finished."""
    budget = BUDGETS[budget_name](load_index(llama_dir))
    tokens = prompt(150)
    fast = run(open_engine(llama_dir, budget=budget), tokens)
    rng = random.Random(3)
    real_mlp = dense_family.mlp_part

    def slow_mlp(*args: Any, **kwargs: Any) -> None:
        time.sleep(rng.uniform(0, 0.003))  # inside a load: its slot must stay put
        real_mlp(*args, **kwargs)

    monkeypatch.setattr(dense_family, "mlp_part", slow_mlp)
    engine = open_engine(llama_dir, budget=budget)
    slow = []
    for layer in engine.prefill(tokens):
        time.sleep(rng.uniform(0, 0.004))  # the consumer between layers
        slow.append(layer)
    assert len(slow) == LAYERS
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_stopping_early_releases_the_loader(
    llama_dir: Path, open_engine: Callable[..., PrefillEngine]
) -> None:
    engine = open_engine(llama_dir, budget=half_layer(load_index(llama_dir)))
    tokens = prompt(60)
    gen = engine.prefill(tokens)
    first = next(gen)
    gen.close()  # the client went away after one layer
    again = run(engine, tokens)
    assert torch.equal(first.k, again[0].k)


# ---------------------------------------------------------------- O_DIRECT reads on a CPU


@pytest.mark.parametrize("how", ["page_cache", "refused_at_read"])
def test_direct_reads_give_the_same_kv_as_the_page_cache(
    how: str,
    tiny_model: MakeTiny,
    open_engine: Callable[..., PrefillEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU engine reads its big pieces with O_DIRECT straight into the slots; with O_DIRECT
    unavailable (tmpfs) or refused at the first read (EINVAL), it reads through the page cache
    and the K/V are bit for bit the same."""
    import errno

    from tandem.nodes.prefill.planning.loads import direct_span
    from tandem.nodes.prefill.stream import reads

    model = tiny_model(arch="qwen2", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512)
    index = load_index(model)
    budget = quarter(index) * 2
    tokens = prompt(90)
    direct = open_engine(model, budget=budget)
    assert direct_files(direct)  # this file system takes O_DIRECT
    placed = [
        (p, o) for ld in direct.plan.loads for p, o in zip(ld.pieces, ld.offsets, strict=True)
    ]
    assert any(direct_span(p, o) for p, o in placed)
    want = run(direct, tokens)
    assert direct_files(direct)  # no read was refused: these K/V came by O_DIRECT
    if how == "page_cache":
        monkeypatch.setattr(reads, "open_direct", lambda files: {})
    else:

        def refuse(*args: object) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(reads, "_pread_direct", refuse)
    other = open_engine(model, budget=budget)
    assert other.plan == direct.plan
    got = run(other, tokens)
    if how == "refused_at_read":
        assert direct_files(other) == set()  # every file dropped back for good
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
