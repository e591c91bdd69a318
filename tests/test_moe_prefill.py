"""Qwen3-MoE (`qwen3_moe`) on the prefill engine against mlx-lm's own prefill, the oracle:
experts stored one by one and stacked, a dense layer mixed in, at a budget that holds the
model, a quarter of the layers and one below a single layer's experts; after a prefix; and
mlx-lm's greedy continuation from our K/V. Made fp32 models, all on CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine

from tests.conftest import MakeTiny
from tests.records import listen
from tests.test_gemma3_prefill import mlx_prefill
from tests.test_prefill_engine import greedy

LAYOUTS = ("per-expert", "stacked", "stacked-4bit")
N = 24  # prompt tokens
STEPS = 6


def moe_args(layout: str) -> dict[str, object]:
    """4 layers (layer 1 dense), 8 experts, top-2; "stacked-4bit": mlx-lm's converter's
    4-bit checkpoint (experts stacked, the router at 8 bits)."""
    quantize = {"quantize": 4, "intermediate": 128} if "4bit" in layout else {}
    return {"arch": "qwen3_moe", "layers": 4, "experts": 8, "top_k": 2, "mlp_only_layers": (1,),
            "expert_layout": layout.removesuffix("-4bit"), "shards": 2, **quantize}  # fmt: skip


def prompt(n: int) -> list[int]:
    return np.random.default_rng(n).integers(0, 512, n).tolist()


def experts_bytes(index: ModelIndex, layer: int) -> int:
    return sum(e.nbytes for k, e in index.layers[layer].items() if "experts" in k or "switch" in k)


BUDGETS: dict[str, Callable[[ModelIndex], int | None]] = {
    "whole": lambda index: None,
    "quarter": lambda index: sum(index.layer_bytes(i) for i in range(4)) // 4,
    "below_experts": lambda index: experts_bytes(index, 0) * 2 // 3,
}


@pytest.fixture(scope="module", params=LAYOUTS)
def moe_dir(request: pytest.FixtureRequest, tiny_model: MakeTiny) -> Path:
    return tiny_model(**moe_args(request.param))


@pytest.fixture(scope="module")
def mlx_model(moe_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(moe_dir))[0]


@pytest.fixture
def open_engine() -> Iterator[Callable[..., PrefillEngine]]:
    engines: list[PrefillEngine] = []

    def make(model: Path, **kwargs: Any) -> PrefillEngine:
        engines.append(PrefillEngine(model, device="cpu", chunk_tokens=8, **kwargs))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def assert_matches(kv: list[Any], cache: list[Any], start: int = 0) -> None:
    for layer, c in zip(kv, cache, strict=True):
        k, v = (
            np.array(c.keys[..., start : c.offset, :]),
            np.array(c.values[..., start : c.offset, :]),
        )
        np.testing.assert_allclose(layer.k.numpy(), k, rtol=0, atol=1e-4, err_msg=f"{layer.layer}")
        np.testing.assert_allclose(layer.v.numpy(), v, rtol=0, atol=1e-4, err_msg=f"{layer.layer}")


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_matches_mlx_lm(
    budget: str, moe_dir: Path, mlx_model: Any, open_engine: Callable[..., PrefillEngine]
) -> None:
    index = load_index(moe_dir)
    assert index.spec.moe is not None and index.spec.moe.sparse == (True, False, True, True)
    engine = open_engine(moe_dir, budget=BUDGETS[budget](index))
    if budget == "below_experts":  # a sparse layer's experts come in more than one load
        loads = [ld for ld in engine.plan.loads if ld.layer == 0]
        assert sum(part.op == "experts" for ld in loads for part in ld.parts) > 1
    tokens = prompt(N)
    kv = list(engine.prefill(tokens))
    assert_matches(kv, mlx_prefill(mlx_model, tokens))


def test_after_a_prefix(
    moe_dir: Path, mlx_model: Any, open_engine: Callable[..., PrefillEngine]
) -> None:
    tokens, k = prompt(N), 9
    index = load_index(moe_dir)
    engine = open_engine(moe_dir, budget=BUDGETS["quarter"](index))
    prefix = [(layer.k, layer.v) for layer in engine.prefill(tokens[:k])]
    rest = list(engine.prefill(tokens[k:], start=k, prefix=prefix))
    assert_matches(rest, mlx_prefill(mlx_model, tokens), start=k)


def test_decode_continues_from_our_kv(
    moe_dir: Path, mlx_model: Any, open_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    tokens = prompt(N)
    index = load_index(moe_dir)
    engine = open_engine(moe_dir, budget=BUDGETS["below_experts"](index))
    caches = []
    for layer in engine.prefill(tokens[:-1]):
        cache = KVCache()
        cache.update_and_fetch(mx.array(layer.k.numpy()), mx.array(layer.v.numpy()))
        caches.append(cache)
    assert greedy(mlx_model, tokens[-1:], caches, STEPS) == greedy(mlx_model, tokens, None, STEPS)


def mlx_choices(model: Any, tokens: list[int]) -> dict[int, list[set[int]]]:
    """Per sparse layer, each token's top-k experts as mlx-lm's own router picks them (its
    gate's logits, recorded on a prefill of `tokens`)."""
    import mlx.core as mx

    k = model.args.num_experts_per_tok
    seen: dict[int, Any] = {}

    class Recording:
        def __init__(self, i: int, gate: Any) -> None:
            self.i, self.gate = i, gate

        def __call__(self, x: Any) -> Any:
            seen[self.i] = out = self.gate(x)
            return out

    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "switch_mlp"):
            layer.mlp.gate = Recording(i, layer.mlp.gate)
    try:
        model(mx.array([tokens]))
    finally:
        for i, layer in enumerate(model.model.layers):
            if i in seen:
                layer.mlp.gate = layer.mlp.gate.gate
    out = {}
    for i, logits in seen.items():
        gates = mx.softmax(logits[0], axis=-1, precise=True)  # [T, E]
        top = mx.argpartition(gates, kth=-k, axis=-1)[:, -k:]
        out[i] = [set(row) for row in top.tolist()]
    return out


@pytest.fixture(scope="module")
def biased(tiny_model: MakeTiny) -> Path:
    """A short prompt routes to few of its experts (the router bias)."""
    return tiny_model(**moe_args("stacked"), router_bias=1.0)


def test_a_short_prompt_streams_exactly_the_routed_experts(
    biased: Path, open_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    model = mlx_lm.load(str(biased))[0]
    index = load_index(biased)
    tokens = prompt(N)
    # a slow link (1.25 MB/s): the experts left unread save more than the routers cost
    engine = open_engine(biased, budget=BUDGETS["quarter"](index), link_gbps=0.01)
    engine.route_experts = "always"  # exactness, whatever a busy machine's timing says
    assert not any(ld.resident for ld in engine.plan.loads)
    all_bytes = engine.stream_weights().bytes_streamed  # every expert
    seen: list[Any] = []
    listen(engine.events, seen.append)
    kv = list(engine.prefill(tokens[:4]))
    assert_matches(kv, mlx_prefill(model, tokens[:4]))
    chosen = mlx_choices(model, tokens[:4])
    used = {i: len(set().union(*rows)) for i, rows in chosen.items()}
    assert engine.last_stats.experts_streamed == used and max(used.values()) < 8
    routed = [e for e in seen if getattr(e, "state", "") == "routed"]  # said as it happens
    assert {e.layer: e.experts for e in routed} == used and all(e.bytes > 0 for e in routed)
    assert sum(e.bytes for e in routed) == engine.last_stats.bytes_by_kind["experts"]
    assert engine.last_stats.bytes_streamed < all_bytes
    kinds = engine.last_stats.bytes_by_kind  # what routing saved shows in the experts' bytes
    assert set(kinds) >= {"attention", "router", "experts"}
    assert sum(kinds.values()) == engine.last_stats.bytes_streamed
    # after a cached prefix, only the new tokens route
    prefix = [(layer.k, layer.v) for layer in engine.prefill(tokens[:9])]
    list(engine.prefill(tokens[9:13], start=9, prefix=prefix))
    later = mlx_choices(model, tokens[:13])
    new = {i: len(set().union(*rows[9:])) for i, rows in later.items()}
    assert engine.last_stats.experts_streamed == new


@pytest.mark.parametrize(("waited_s", "saved_bytes", "keeps_waiting"), [(0.05, 1000, True),
                         (0.5, 1000, False), (0.5, 10**6, True)])  # fmt: skip
def test_waiting_for_routers_stops_once_it_costs_more_than_it_saves(
    waited_s: float, saved_bytes: int, keeps_waiting: bool
) -> None:
    """Loads have filled at 10 kB/s: 1000 bytes left unread saved 0.1 s of the link."""
    from tandem.nodes.prefill.stream.routing import Routing

    routing = Routing(saved_bytes=saved_bytes)
    routing.check_cost(waited_s, nbytes=10_000, busy_s=1.0)
    assert routing.waits is keeps_waiting
    always = Routing("always", saved_bytes=saved_bytes)
    always.check_cost(waited_s, nbytes=10_000, busy_s=1.0)
    assert always.waits
