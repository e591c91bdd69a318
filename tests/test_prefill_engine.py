"""The layer-streamed prefill engine against mlx-lm, the correctness oracle (DESIGN.md), and the
streamer's guarantees: the budget, the resident set, real overlap, order under slow movers.

All on CPU. mlx-lm is needed only by the oracle tests (they skip without it).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.contract.events import Event, LayerEvent, LinkEvent
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.families import llama as dense_family
from tandem.nodes.prefill.handover import LayerKV
from tandem.nodes.prefill.loads import Load
from tandem.nodes.prefill.plan import make_plan
from tandem.nodes.prefill.stream.movers import CpuMover, FillTimes

from tests.conftest import MakeTiny

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 8
CHUNK = 40  # tokens: small, so attention and the MLP run in several chunks
STEPS = 32  # greedy tokens compared with mlx-lm
PROMPT = {"llama": 50, "mistral": 130, "qwen2": 257, "qwen3": 400}  # n, prompt length


def model_args(arch: str, **extra: object) -> dict[str, object]:
    """8 layers: a quarter of them leaves room for a resident layer next to the ring."""
    scaling = "llama3" if arch == "llama" else "none"
    return {"arch": arch, "layers": LAYERS, "shards": 2, "rope_scaling": scaling, **extra}


def prompt(n: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(n).integers(0, vocab, n).tolist()


def quarter(index: ModelIndex) -> int:
    return sum(index.layer_bytes(i) for i in range(index.spec.num_layers)) // 4


def half_layer(index: ModelIndex) -> int:
    return index.layer_bytes(0) // 2


BUDGETS: dict[str, Callable[[ModelIndex], int]] = {"quarter": quarter, "half_layer": half_layer}


@pytest.fixture
def open_engine() -> Iterator[Callable[..., PrefillEngine]]:
    """`open_engine(dir, budget=...)`: a CPU engine with small chunks, closed after the test."""
    engines: list[PrefillEngine] = []

    def make(model: Path, **kwargs: Any) -> PrefillEngine:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("chunk_tokens", CHUNK)
        engine = PrefillEngine(model, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def run(engine: PrefillEngine, tokens: Sequence[int], **kwargs: Any) -> list[LayerKV]:
    """Every layer's K/V, checking what holds for every run: all layers in order, the budget."""
    kv = list(engine.prefill(tokens, **kwargs))
    assert [layer.layer for layer in kv] == list(range(engine.spec.num_layers))
    stats = engine.last_stats
    assert stats.peak_weight_bytes <= engine.budget
    assert stats.peak_weight_bytes == engine.plan.pool_bytes
    assert stats.tokens == len(tokens) and stats.layers == engine.spec.num_layers
    return kv


# ---------------------------------------------------------------- the mlx-lm oracle


@dataclass
class Oracle:
    """mlx-lm's view of one model and prompt: its prefill K/V and greedy continuation."""

    model: Any
    tokens: list[int]
    keys: list[np.ndarray] = field(default_factory=list)  # per layer [1, n_kv, n-1, D]
    values: list[np.ndarray] = field(default_factory=list)
    greedy: list[int] = field(default_factory=list)  # STEPS tokens from scratch


def mlx_prefill(model: Any, tokens: Sequence[int]) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def greedy(
    model: Any, prompt_tokens: Sequence[int], cache: list[Any] | None = None, n: int = STEPS
) -> list[int]:
    """mlx-lm's own greedy tokens (`n` of them) after `prompt_tokens` and `cache`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(
        mx.array(list(prompt_tokens)),
        model,
        max_tokens=n,
        sampler=lambda logits: mx.argmax(logits, axis=-1),
        prompt_cache=cache,
    )
    return [int(token) for token, _ in steps]


def to_mx(t: torch.Tensor) -> Any:
    import mlx.core as mx

    if t.dtype == torch.bfloat16:  # raw bits, never through float32
        return mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def mlx_cache(kv: Sequence[LayerKV]) -> list[Any]:
    """mlx-lm KVCaches holding our K/V, as the decode node builds them."""
    from mlx_lm.models.cache import KVCache

    caches = []
    for layer in kv:
        cache = KVCache()
        cache.update_and_fetch(to_mx(layer.k), to_mx(layer.v))
        caches.append(cache)
    return caches


@pytest.fixture(scope="module")
def oracle(tiny_model: MakeTiny) -> Callable[[str], Oracle]:
    """`oracle(arch)`: mlx-lm loaded once per family, with its prefill and greedy tokens."""
    pytest.importorskip("mlx_lm")
    import mlx_lm

    made: dict[str, Oracle] = {}

    def get(arch: str) -> Oracle:
        if arch not in made:
            model, _ = mlx_lm.load(str(tiny_model(**model_args(arch))))
            tokens = prompt(PROMPT[arch])
            cache = mlx_prefill(model, tokens[:-1])
            n = len(tokens)
            made[arch] = Oracle(
                model,
                tokens,
                keys=[np.array(c.keys[..., : n - 1, :]) for c in cache],
                values=[np.array(c.values[..., : n - 1, :]) for c in cache],
                greedy=greedy(model, tokens),
            )
        return made[arch]

    return get


@pytest.mark.parametrize("budget_name", list(BUDGETS))
@pytest.mark.parametrize("arch", list(PROMPT))
def test_matches_mlx_lm(
    arch: str,
    budget_name: str,
    tiny_model: MakeTiny,
    oracle: Callable[[str], Oracle],
    open_engine: Callable[..., PrefillEngine],
) -> None:
    model_dir = tiny_model(**model_args(arch))
    index = load_index(model_dir)
    budget = BUDGETS[budget_name](index)
    ref = oracle(arch)
    n = len(ref.tokens)
    engine = open_engine(model_dir, budget=budget)
    assert engine.plan.granularity == "slice"  # layers really stream in pieces
    assert bool(engine.plan.resident_layers) == (budget_name == "quarter")
    kv = run(engine, ref.tokens[:-1])
    spec = engine.spec
    for layer in kv:
        assert layer.k.shape == (1, spec.num_kv_heads, n - 1, spec.head_dim)
        assert layer.k.dtype == layer.v.dtype == torch.float32
        np.testing.assert_allclose(layer.k.numpy(), ref.keys[layer.layer], rtol=0, atol=1e-4)
        np.testing.assert_allclose(layer.v.numpy(), ref.values[layer.layer], rtol=0, atol=1e-4)
    cache = mlx_cache(kv)
    assert cache[0].offset == n - 1
    # decode continues from our cache with the last prompt token, exactly like mlx-lm alone
    assert greedy(ref.model, [ref.tokens[-1]], cache) == ref.greedy


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_within_rounding_of_mlx_lm(
    arch: str, tiny_model: MakeTiny, open_engine: Callable[..., PrefillEngine]
) -> None:
    """torch and mlx round bf16 differently, so compare with rounding-aware tolerances.

    bf16 keeps 8 significant bits (relative step 2^-8 ≈ 0.4%); each layer adds a few such
    roundings to the residual stream, so deep layers drift by ~1-2% (relative norm) from mlx.
    Layer 0 sees only the embedding: elementwise within a couple of steps. And we must be as
    close to the float32 truth (the same bf16 weights computed in float32) as mlx-lm's own
    bf16 path is.
    """
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx_lm

    model_dir = tiny_model(**model_args(arch, dtype="bfloat16"))
    tokens = prompt(300)
    n = len(tokens)
    model16, _ = mlx_lm.load(str(model_dir))
    model32, _ = mlx_lm.load(str(model_dir))
    model32.set_dtype(mx.float32)
    ref16, ref32 = mlx_prefill(model16, tokens[:-1]), mlx_prefill(model32, tokens[:-1])
    engine = open_engine(model_dir, budget=half_layer(load_index(model_dir)))
    kv = run(engine, tokens[:-1])

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    for layer in kv:
        assert layer.k.dtype == layer.v.dtype == torch.bfloat16
        for ours_t, c16, c32 in (
            (layer.k, ref16[layer.layer].keys, ref32[layer.layer].keys),
            (layer.v, ref16[layer.layer].values, ref32[layer.layer].values),
        ):
            ours = ours_t.float().numpy()
            mlx16 = np.array(c16[..., : n - 1, :].astype(mx.float32))
            truth = np.array(c32[..., : n - 1, :])
            assert rel(ours, mlx16) < 0.03, f"layer {layer.layer}"
            assert np.abs(ours - mlx16).max() < 0.25, f"layer {layer.layer}"
            assert rel(ours, truth) < 2 * rel(mlx16, truth) + 1e-3, f"layer {layer.layer}"
            if layer.layer == 0:
                np.testing.assert_allclose(ours, mlx16, atol=0.05, rtol=0.05)
    # first decode step: the last prompt token on our cache vs mlx-lm on the whole prompt
    ours_logits = model16(mx.array([[tokens[-1]]]), cache=mlx_cache(kv))[0, -1]
    ref_logits = model16(mx.array([tokens]))[0, -1]
    diff = mx.abs(ours_logits.astype(mx.float32) - ref_logits.astype(mx.float32))
    assert float(diff.max()) < 0.25
    assert float(mx.abs(ref_logits).max()) > 2.0  # the logits are not trivially small


# ---------------------------------------------------------------- requests and the resident set


@pytest.fixture(scope="module")
def llama_dir(tiny_model: MakeTiny) -> Path:
    return tiny_model(**model_args("llama"))


@pytest.mark.parametrize("k", [1, 77])
def test_start_continues_a_prefix(
    k: int, llama_dir: Path, open_engine: Callable[..., PrefillEngine]
) -> None:
    tokens = prompt(200)
    engine = open_engine(llama_dir, budget=quarter(load_index(llama_dir)))
    full = run(engine, tokens)
    prefix = [(layer.k[:, :, :k], layer.v[:, :, :k]) for layer in full]
    rest = run(engine, tokens[k:], start=k, prefix=prefix)
    for one, two in zip(full, rest, strict=True):
        assert two.k.shape[2] == len(tokens) - k
        torch.testing.assert_close(two.k, one.k[:, :, k:], rtol=0, atol=1e-5)
        torch.testing.assert_close(two.v, one.v[:, :, k:], rtol=0, atol=1e-5)
    # positions matter: the same tokens prefilled from position 0 give other keys
    alone = run(engine, tokens[k:])
    assert not torch.allclose(alone[0].k, full[0].k[:, :, k:], atol=1e-3)


def test_bad_requests_are_refused(
    llama_dir: Path, open_engine: Callable[..., PrefillEngine]
) -> None:
    engine = open_engine(llama_dir, budget=quarter(load_index(llama_dir)))
    for tokens in ([], [1, 512], [-1], [1, 2.0]):
        with pytest.raises(PrefillError):
            list(engine.prefill(tokens))  # type: ignore[arg-type]
    with pytest.raises(PrefillError, match="prefix"):
        list(engine.prefill([1, 2, 3], start=2))
    bad_prefix = [(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))] * LAYERS
    with pytest.raises(PrefillError, match="shape"):
        list(engine.prefill([1, 2, 3], start=2, prefix=bad_prefix))
    assert len(run(engine, [1, 2, 3])) == LAYERS  # the engine still works after refusals


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
    engine.events.add_listener(events.append)
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


# ---------------------------------------------------------------- import boundary


def test_engine_imports_without_mlx_textual_aiohttp() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        import tandem.nodes.prefill.engine
        print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert "torch" in loaded and "tandem" in loaded  # the check sees what was imported
    assert not loaded & {"mlx", "mlx_lm", "textual", "aiohttp"}


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

    from tandem.nodes.prefill.loads import direct_span
    from tandem.nodes.prefill.stream import reads

    model = tiny_model(arch="qwen2", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512)
    index = load_index(model)
    budget = quarter(index) * 2
    tokens = prompt(90)
    direct = open_engine(model, budget=budget)
    assert direct.streamer.mover._reader.direct_files  # this file system takes O_DIRECT
    placed = [
        (p, o) for ld in direct.plan.loads for p, o in zip(ld.pieces, ld.offsets, strict=True)
    ]
    assert any(direct_span(p, o) for p, o in placed)
    want = run(direct, tokens)
    assert (
        direct.streamer.mover._reader.direct_files
    )  # no read was refused: these K/V came by O_DIRECT
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
        assert (
            other.streamer.mover._reader.direct_files == set()
        )  # every file dropped back for good
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_device_thread_yields_the_cpu_to_the_event_loop() -> None:
    """The prefill node's device thread runs below the event loop that sends the K/V (and
    threads it starts inherit that); the loader runs lower still."""
    import os
    import threading
    from types import SimpleNamespace

    from tandem.nodes.contract.events import EventBus
    from tandem.nodes.prefill.server import PrefillService
    from tandem.nodes.prefill.stream.streamer import DEVICE_NICE, LOADER_NICE, lower_this_thread

    def nice_here() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def device_then_loader() -> tuple[int, int]:
        device = nice_here()
        box: list[int] = []
        loader = threading.Thread(
            target=lambda: (lower_this_thread(LOADER_NICE), box.append(nice_here()))
        )
        loader.start()
        loader.join()
        return device, box[0]

    base = nice_here()
    service = PrefillService(SimpleNamespace(close=lambda: None), "fp", EventBus())  # type: ignore[arg-type]
    try:
        device, loader = service.device_thread.submit(device_then_loader).result()
    finally:
        service.close()
    assert device == max(base, DEVICE_NICE) and loader >= device >= base
    assert nice_here() == base  # only that thread moved
    # on CUDA the loader (started from the device thread) is the critical path, and a thread
    # cannot raise its priority back once lowered: the device thread is left as it is
    gpu = PrefillService(SimpleNamespace(), "fp", EventBus())  # type: ignore[arg-type]
    gpu._engine = SimpleNamespace(device=torch.device("cuda"), close=lambda: None)  # type: ignore[assignment]
    try:
        assert gpu.device_thread.submit(nice_here).result() == base
    finally:
        gpu.close()
