"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) on the prefill engine against mlx-lm's own prefill, the
oracle: every full layer's K/V and every linear layer's state (conv, recurrent), in the
Hugging Face layout and mlx-lm's, for a prompt shorter than the conv kernel and one of several
chunks, at a budget that holds the model and at a quarter of it; after a prefix; mlx-lm's
greedy continuation from our K/V and states; at 4 bits; and the MoE variant reading only
the experts mlx-lm's router picks.

Made fp32 models of 8 layers (linear, linear, linear, full, ...), 16-token chunks. All on
CPU; the prefix cache with states is in test_qwen3_5_prefill_cache.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import Handed, LayerKV, LinearState
from tandem.nodes.prefill.prefix_upload import Prefix

from tests.conftest import MakeTiny
from tests.records import listen
from tests.test_gemma3_prefill import mlx_prefill
from tests.test_moe_prefill import mlx_choices
from tests.test_prefill_engine import greedy

LAYERS = 8
CHUNK = 16  # tokens per query chunk: the long prompt takes three
SHORT, LONG = 2, 40  # prompt lengths: fewer than the conv kernel's 4, and several chunks
STEPS = 8  # greedy tokens compared with mlx-lm
MODELS = [(arch, layout) for arch in ("qwen3_5", "qwen3_5_moe") for layout in ("hf", "mlx")]


def qwen_args(arch: str, **extra: object) -> dict[str, object]:
    """8 layers, every 4th full attention; the MoE variant 8 experts, top-2, 32 wide."""
    return {"arch": arch, "layers": LAYERS, "experts": 8, "top_k": 2, "moe_intermediate": 32,
            **extra}  # fmt: skip


def prompt(n: int) -> list[int]:
    return np.random.default_rng(n).integers(0, 512, n).tolist()


def quarter(index: ModelIndex) -> int:
    return sum(index.layer_bytes(i) for i in range(LAYERS)) // 4


BUDGETS: dict[str, Callable[[ModelIndex], int | None]] = {
    "whole": lambda index: None,  # the engine's default: every layer resident
    "quarter": quarter,
}


@pytest.fixture(scope="module", params=MODELS, ids=["-".join(m) for m in MODELS])
def made(request: pytest.FixtureRequest, tiny_model: MakeTiny) -> tuple[Path, Any]:
    """A model directory in one layout and mlx-lm's model loaded from it."""
    import mlx_lm

    arch, layout = request.param
    model_dir = tiny_model(**qwen_args(arch, layout=layout))
    return model_dir, mlx_lm.load(str(model_dir))[0]


@pytest.fixture
def open_engine() -> Iterator[Callable[..., PrefillEngine]]:
    engines: list[PrefillEngine] = []

    def make(model: Path, **kwargs: Any) -> PrefillEngine:
        engines.append(PrefillEngine(model, device="cpu", chunk_tokens=CHUNK, **kwargs))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def run(engine: PrefillEngine, tokens: Sequence[int], **kwargs: Any) -> list[Handed]:
    """Every layer's handover, in order: a state for a linear layer, K/V for a full one."""
    handed = list(engine.prefill(tokens, **kwargs))
    assert [layer.layer for layer in handed] == list(range(LAYERS))
    for layer, kind in zip(handed, engine.spec.layer_kinds, strict=True):
        assert isinstance(layer, LinearState if kind.kind == "linear" else LayerKV)
    return handed


def assert_matches(handed: Sequence[Handed], cache: list[Any], start: int = 0) -> None:
    """Our K/V of positions start.. and our states equal mlx-lm's caches (an ArraysCache's
    slots: conv [1, K-1, conv_dim], recurrent [1, Hv, Dv, Dk] float32)."""
    from mlx_lm.models.cache import ArraysCache

    for layer, c in zip(handed, cache, strict=True):
        where = f"layer {layer.layer}"
        if isinstance(layer, LinearState):
            assert isinstance(c, ArraysCache), where
            assert set(layer.tensors) == {"conv", "recurrent"}
            assert layer.tensors["recurrent"].dtype == torch.float32
            for name, theirs in (("conv", c[0]), ("recurrent", c[1])):
                ours = layer.tensors[name].numpy()
                assert ours.shape == theirs.shape, f"{where} {name}"
                np.testing.assert_allclose(ours, np.array(theirs), rtol=0, atol=1e-4,
                                           err_msg=f"{where} {name}")  # fmt: skip
            continue
        assert not isinstance(c, ArraysCache), where
        for ours, theirs in ((layer.k, c.keys), (layer.v, c.values)):
            np.testing.assert_allclose(ours.numpy(), np.array(theirs[..., start : c.offset, :]),
                                       rtol=0, atol=1e-4, err_msg=where)  # fmt: skip


def as_prefix(handed: Sequence[Handed]) -> list[Prefix]:
    """What the engine takes back as `prefix`: K/V per full layer, the state dict per linear."""
    return [h.tensors if isinstance(h, LinearState) else (h.k, h.v) for h in handed]


def filled_caches(model: Any, handed: Sequence[Handed]) -> list[Any]:
    """mlx-lm's own caches (`make_prompt_cache`) filled as a prefill fills them: our K/V
    through `update_and_fetch`, our states into the slots."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    for layer, c in zip(handed, caches, strict=True):
        if isinstance(layer, LinearState):
            c[0] = mx.array(layer.tensors["conv"].numpy())
            c[1] = mx.array(layer.tensors["recurrent"].numpy())
        else:
            c.update_and_fetch(mx.array(layer.k.numpy()), mx.array(layer.v.numpy()))
    return caches


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("n", [SHORT, LONG])
def test_matches_mlx_lm(
    n: int, budget: str, made: tuple[Path, Any], open_engine: Callable[..., PrefillEngine]
) -> None:
    model_dir, model = made
    engine = open_engine(model_dir, budget=BUDGETS[budget](load_index(model_dir)))
    assert (engine.plan.n_slots > 0) == (budget == "quarter")  # a quarter really streams
    tokens = prompt(n)
    assert_matches(run(engine, tokens), mlx_prefill(model, tokens))


@pytest.mark.parametrize("k", [SHORT, 21])  # a prefix shorter than the conv kernel; mid-chunk
def test_after_a_prefix(
    k: int, made: tuple[Path, Any], open_engine: Callable[..., PrefillEngine]
) -> None:
    """The rest after the first k tokens' K/V and states, against mlx-lm prefilling in the
    same two calls."""
    model_dir, model = made
    tokens = prompt(LONG)
    engine = open_engine(model_dir, budget=quarter(load_index(model_dir)))
    first = run(engine, tokens[:k])
    rest = run(engine, tokens[k:], start=k, prefix=as_prefix(first))
    assert_matches(rest, mlx_prefill(model, tokens[:k], tokens[k:]), start=k)


def test_decode_continues_from_our_states(
    made: tuple[Path, Any], open_engine: Callable[..., PrefillEngine]
) -> None:
    model_dir, model = made
    tokens = prompt(LONG)
    engine = open_engine(model_dir, budget=quarter(load_index(model_dir)))
    assert engine.plan.n_slots > 0
    caches = filled_caches(model, run(engine, tokens[:-1]))
    assert greedy(model, tokens[-1:], caches, STEPS) == greedy(model, tokens, None, STEPS)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_quantized_matches_mlx_lm(
    arch: str, tiny_model: MakeTiny, open_engine: Callable[..., PrefillEngine]
) -> None:
    """mlx-lm's 4-bit checkpoint (mlx layout), at the smallest of a quarter and a half of the
    packed layers' bytes that holds a load: the dense model's quarter cannot hold a linear
    mixer dequantized beside its packed words (never cut), its half can."""
    import mlx_lm

    # every quantized input width whole groups of 64
    extra = {"intermediate": 128} if arch == "qwen3_5" else {"moe_intermediate": 64}
    model_dir = tiny_model(**qwen_args(arch, quantize=4, **extra))
    model = mlx_lm.load(str(model_dir))[0]
    index = load_index(model_dir)
    budget = quarter(index) * (2 if arch == "qwen3_5" else 1)
    engine = open_engine(model_dir, budget=budget)
    assert engine.spec.quantization.quantized and engine.plan.n_slots > 0
    tokens = prompt(LONG)
    handed = run(engine, tokens[:-1])
    assert_matches(handed, mlx_prefill(model, tokens[:-1]))
    caches = filled_caches(model, handed)
    assert greedy(model, tokens[-1:], caches, STEPS) == greedy(model, tokens, None, STEPS)


class _MoeView:
    """mlx-lm's Qwen3.5-MoE as `mlx_choices` reads a Qwen3-MoE (`.model.layers` whose sparse
    `mlp` has a `gate` and `switch_mlp`, `.args.num_experts_per_tok`)."""

    def __init__(self, model: Any, top_k: int) -> None:
        self._model, self.model = model, model.model
        self.args = SimpleNamespace(num_experts_per_tok=top_k)

    def __call__(self, inputs: Any) -> Any:
        return self._model(inputs)


def test_a_short_prompt_streams_only_the_routed_experts(
    tiny_model: MakeTiny, open_engine: Callable[..., PrefillEngine]
) -> None:
    """Below one layer's bytes (its experts in two loads), a 3-token prompt reads only the
    experts mlx-lm's router picks (the shared expert rides with the router), and the K/V and
    states still match."""
    import mlx_lm

    model_dir = tiny_model(**qwen_args("qwen3_5_moe"))
    model = mlx_lm.load(str(model_dir))[0]
    index = load_index(model_dir)
    engine = open_engine(model_dir, budget=index.layer_bytes(0) // 2)
    engine.route_experts = "always"  # exactness, whatever a busy machine's timing says
    loads = [ld for ld in engine.plan.loads if ld.layer == 0]
    assert len(loads) > 1 and not any(ld.resident for ld in engine.plan.loads)
    seen: list[Any] = []
    listen(engine.events, seen.append)
    tokens = prompt(3)
    assert_matches(run(engine, tokens), mlx_prefill(model, tokens))
    chosen = mlx_choices(_MoeView(model, 2), tokens)
    used = {i: len(set().union(*rows)) for i, rows in chosen.items()}
    assert sorted(used) == list(range(LAYERS)) and max(used.values()) < 8
    assert engine.last_stats.experts_streamed == used
    routed = [e for e in seen if getattr(e, "state", "") == "routed"]
    assert {e.layer: e.experts for e in routed} == used
    assert sum(e.bytes for e in routed) == engine.last_stats.bytes_by_kind["experts"]
