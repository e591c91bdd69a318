"""gpt-oss (`gpt_oss`) on the prefill engine against mlx-lm's own prefill, the oracle: attention
sinks, YaRN RoPE, sliding layers (a short window here) beside full ones, 8 experts top-2 with
biases and the clamped SwiGLU; at a budget that holds the model, a quarter of it and one below
a layer's experts; prompts shorter and longer than the window; after a prefix; mlx-lm's greedy
continuation from our K/V; only the routed experts streamed for a short prompt. Made float32
models (mlx-lm's own `gpt_oss` class), all on CPU."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.spec import LayerKind, load_spec
from tandem.nodes.prefill.engine import PrefillEngine

from tests.conftest import MakeTiny
from tests.test_gemma3_prefill import held, mlx_prefill
from tests.test_prefill_engine import greedy

WINDOW = 16
ARGS: dict[str, Any] = {
    "arch": "gpt_oss", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
    "experts": 8, "top_k": 2, "moe_intermediate": 64, "sliding_window": WINDOW,
    "rope_scaling": "yarn",
}  # fmt: skip


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng([n, seed]).integers(0, 300, n).tolist()


def experts_bytes(index: ModelIndex, layer: int) -> int:
    return sum(e.nbytes for k, e in index.layers[layer].items() if k.startswith("mlp.experts."))


BUDGETS: dict[str, Callable[[ModelIndex], int | None]] = {
    "whole": lambda index: None,
    "quarter": lambda index: sum(index.layer_bytes(i) for i in range(4)) // 4,
    "below_experts": lambda index: experts_bytes(index, 0) * 2 // 3,
}


@pytest.fixture(scope="module")
def model_dir(tiny_model: MakeTiny) -> Path:
    return tiny_model(**ARGS)


@pytest.fixture(scope="module")
def mlx_model(model_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(model_dir))[0]


def assert_matches(kv: Sequence[Any], cache: list[Any], start: int = 0, atol: float = 1e-4) -> None:
    """Our K/V of positions start.. equal mlx-lm's wherever its cache holds them (a sliding
    layer's: its window and what the last call added)."""
    from mlx_lm.models.cache import RotatingKVCache

    for layer, c in zip(kv, cache, strict=True):
        assert isinstance(c, RotatingKVCache) == (layer.layer % 2 == 0)  # sliding first
        positions, k, v = held(c)
        lo = max(start, positions.start)
        ours, theirs = slice(lo - start, positions.stop - start), slice(lo - positions.start, None)
        for a, b in ((layer.k, k), (layer.v, v)):
            np.testing.assert_allclose(a[:, :, ours].numpy(), b[:, :, theirs], rtol=0, atol=atol,
                                       err_msg=f"layer {layer.layer}")  # fmt: skip


def test_spec(model_dir: Path) -> None:
    spec = load_spec(model_dir)
    assert spec.family == "gpt_oss" and spec.attention_sinks and spec.output_bias
    assert spec.layer_kinds == (LayerKind("sliding", WINDOW), LayerKind()) * 2
    assert spec.moe is not None and (spec.moe.num_experts, spec.moe.experts_per_token) == (8, 2)
    assert spec.rope_scaling is not None and spec.rope_scaling.kind == "yarn"
    assert (spec.rope_scaling.factor, spec.rope_scaling.original_max_position_embeddings) == (
        32.0, 4096,
    )  # fmt: skip


def test_a_config_mlx_lm_would_read_otherwise_is_refused(model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for bad in ({"swiglu_limit": 10.0}, {"layer_types": ["full_attention"] * 4}):
        (tmp_path / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ModelError, match=r"swiglu_limit|layer_types"):
            load_spec(tmp_path)


@pytest.mark.parametrize("n", [WINDOW - 6, 3 * WINDOW + 5])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_matches_mlx_lm(
    budget: str, n: int, model_dir: Path, mlx_model: Any, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    index = load_index(model_dir)
    engine = cpu_engine(model_dir, budget=BUDGETS[budget](index))
    if budget == "below_experts":  # a layer's experts come in more than one load
        loads = [ld for ld in engine.plan.loads if ld.layer == 0]
        assert sum(part.op == "experts" for ld in loads for part in ld.parts) > 1
    if budget != "whole":
        assert not all(ld.resident for ld in engine.plan.loads)
    tokens = prompt(n)
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(mlx_model, tokens))


def test_after_a_prefix(
    model_dir: Path, mlx_model: Any, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    tokens, k = prompt(3 * WINDOW), WINDOW + 3
    engine = cpu_engine(model_dir, budget=BUDGETS["quarter"](load_index(model_dir)))
    prefix = [(layer.k, layer.v) for layer in engine.prefill(tokens[:k])]
    rest = list(engine.prefill(tokens[k:], start=k, prefix=prefix))
    assert_matches(rest, mlx_prefill(mlx_model, tokens[:k], tokens[k:]), start=k)


def test_decode_continues_from_our_kv(
    model_dir: Path, mlx_model: Any, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = prompt(2 * WINDOW + 3)
    engine = cpu_engine(model_dir, budget=BUDGETS["below_experts"](load_index(model_dir)))
    caches = make_prompt_cache(mlx_model)
    for layer, cache in zip(engine.prefill(tokens[:-1]), caches, strict=True):
        k, v = mx.array(layer.k.numpy()), mx.array(layer.v.numpy())
        cache.update_and_fetch(k, v)  # a rotating cache keeps the window, as after a prefill
    assert greedy(mlx_model, tokens[-1:], caches, 8) == greedy(mlx_model, tokens, None, 8)


def mlx_choices(model: Any, tokens: list[int]) -> dict[int, set[int]]:
    """Per layer, the experts mlx-lm's router picks for any of `tokens` (its logits, recorded
    on a prefill)."""
    import mlx.core as mx

    k, seen = model.args.num_experts_per_tok, {}

    class Recording:
        def __init__(self, i: int, router: Any) -> None:
            self.i, self.router = i, router

        def __call__(self, x: Any) -> Any:
            seen[self.i] = out = self.router(x)
            return out

    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer.mlp.router = Recording(i, layer.mlp.router)
    try:
        model(mx.array([tokens]))
    finally:
        for layer in layers:
            layer.mlp.router = layer.mlp.router.router
    return {
        i: set(mx.argpartition(logits[0], kth=-k, axis=-1)[:, -k:].flatten().tolist())
        for i, logits in seen.items()
    }


def test_a_short_prompt_streams_exactly_the_routed_experts(
    tiny_model: MakeTiny, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    biased = tiny_model(**ARGS, router_bias=2.0)
    model = mlx_lm.load(str(biased))[0]
    index = load_index(biased)
    engine = cpu_engine(biased, budget=BUDGETS["quarter"](index), link_gbps=0.01)
    engine.route_experts = "always"
    all_bytes = engine.stream_weights().bytes_streamed
    tokens = prompt(8, seed=3)
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(model, tokens))
    used = {i: len(chosen) for i, chosen in mlx_choices(model, tokens).items()}
    assert engine.last_stats.experts_streamed == used and max(used.values()) < 8
    assert engine.last_stats.bytes_streamed < all_bytes
