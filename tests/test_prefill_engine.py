"""The layer-streamed prefill engine against mlx-lm, the correctness oracle (DESIGN.md), the
budget on every run, requests it continues or refuses, its import boundary and thread
priorities. The streamer's guarantees (resident set, overlap, slow movers, O_DIRECT) are in
test_prefill_engine_streaming.py.

All on CPU. mlx-lm is needed only by the oracle tests (they skip without it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.handover import LayerKV

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


def engine_opener(chunk: int) -> Iterator[Callable[..., PrefillEngine]]:
    """An `open_engine` fixture's body: `open_engine(dir, budget=...)` makes a CPU engine of
    `chunk` tokens a chunk (unless told otherwise), closed after the test."""
    engines: list[PrefillEngine] = []

    def make(model: Path, **kwargs: Any) -> PrefillEngine:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("chunk_tokens", chunk)
        engine = PrefillEngine(model, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def open_engine() -> Iterator[Callable[..., PrefillEngine]]:
    """`open_engine(dir, budget=...)`: a CPU engine with small chunks, closed after the test."""
    yield from engine_opener(CHUNK)


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


# ---------------------------------------------------------------- requests


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


def test_device_thread_yields_the_cpu_to_the_event_loop() -> None:
    """The prefill node's device thread runs below the event loop that sends the K/V (and
    threads it starts inherit that); the loader runs lower still."""
    import os
    import threading
    from types import SimpleNamespace

    from tandem.nodes.contract.events import EventBus
    from tandem.nodes.prefill.serving.server import PrefillService
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
    gpu._engine = SimpleNamespace(  # type: ignore[assignment]
        device=torch.device("cuda"), close=lambda: None, collective=None
    )
    try:
        assert gpu.device_thread.submit(nice_here).result() == base
    finally:
        gpu.close()


def test_half_precision_matmuls_reduce_in_float32_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45: a CUDA engine turns off cuBLAS's reduced-precision split-K reductions (the
    flags are torch's globals, so this runs without a GPU); a CPU engine leaves them."""
    from tandem.nodes.prefill.planning.budget import exact_reductions

    matmul = torch.backends.cuda.matmul
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", True)
    monkeypatch.setattr(matmul, "allow_fp16_reduced_precision_reduction", True)
    exact_reductions(torch.device("cpu"))
    assert matmul.allow_bf16_reduced_precision_reduction
    exact_reductions(torch.device("cuda", 0))
    assert not matmul.allow_bf16_reduced_precision_reduction
    assert not matmul.allow_fp16_reduced_precision_reduction
