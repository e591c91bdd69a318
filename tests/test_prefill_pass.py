"""One weight pass, many prompts (issue 46): the engine's `prefill_pass` streams the weights
once for every prompt in it, and each prompt's K/V (or state) is its lone run's, bit for bit;
a dropped prompt leaves the others exact; a mixture of experts reads the union of the pass's
routed experts once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model import load_index
from tandem.nodes.prefill.batch import Ask
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import Handed, LayerKV

from tests.conftest import MakeTiny
from tests.test_prefill_engine import engine_opener

LENGTHS = (37, 5, 80, 19)  # four prompts of different lengths


@pytest.fixture
def open_engine() -> Iterator[Callable[..., PrefillEngine]]:
    yield from engine_opener(16)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, n).tolist() for n in LENGTHS]


def _tensors(item: Handed) -> dict[str, torch.Tensor]:
    return {"k": item.k, "v": item.v} if isinstance(item, LayerKV) else dict(item.tensors)


def _lone(engine: PrefillEngine, tokens: list[int]) -> list[dict[str, torch.Tensor]]:
    return [_tensors(item) for item in engine.prefill(tokens)]


def _assert_same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for layer, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), layer
        for name in a:
            assert torch.equal(a[name], b[name]), (layer, name)


@pytest.mark.parametrize(
    "model",
    [
        {"arch": "llama", "layers": 6},
        {"arch": "gemma3", "layers": 6, "sliding_window": 8},
        {"arch": "qwen3_5", "layers": 4},
    ],
    ids=["llama", "gemma3", "qwen3_5"],
)
def test_one_pass_serves_four_prompts_each_as_its_lone_run(
    tiny_model: MakeTiny, open_engine: Callable[..., PrefillEngine], model: dict[str, Any]
) -> None:
    path: Path = tiny_model(**model)
    index = load_index(path)
    layers = index.spec.num_layers
    engine = open_engine(path, budget=sum(index.layer_bytes(i) for i in range(layers)) // 4)
    prompts = _prompts(index.spec.vocab_size)
    lone = [_lone(engine, p) for p in prompts]
    one_pass = engine.last_stats.bytes_streamed  # a lone run's: every streamed load once
    asks = [Ask(p) for p in prompts]
    got: list[list[dict[str, torch.Tensor]]] = [[] for _ in prompts]
    order = []
    for i, item in engine.prefill_pass(asks):
        got[i].append(_tensors(item))
        order.append((i, item.layer))
    for mine, want in zip(got, lone, strict=True):
        _assert_same(mine, want)
    assert engine.last_stats.bytes_streamed == one_pass  # the weights crossed once for four
    # each prompt's layer leaves as soon as it is done: layer by layer, every prompt's
    assert [layer for _, layer in order] == sorted(layer for _, layer in order)


def test_a_dropped_prompt_leaves_the_others_exact(
    tiny_model: MakeTiny, open_engine: Callable[..., PrefillEngine]
) -> None:
    path = tiny_model(arch="llama", layers=6)
    index = load_index(path)
    engine = open_engine(path, budget=sum(index.layer_bytes(i) for i in range(6)) // 4)
    prompts = _prompts(index.spec.vocab_size)
    lone = [_lone(engine, p) for p in prompts]
    asks = [Ask(p) for p in prompts]
    got: list[list[dict[str, torch.Tensor]]] = [[] for _ in prompts]
    for i, item in engine.prefill_pass(asks):
        got[i].append(_tensors(item))
        if i == 1 and item.layer == 1:
            asks[1].dropped.set()  # its reader went away after two layers
    assert len(got[1]) == 2
    for i in (0, 2, 3):
        _assert_same(got[i], lone[i])
    # nobody left: the pass ends at once
    for ask in (quiet := [Ask(p) for p in prompts]):
        ask.dropped.set()
    assert list(engine.prefill_pass(quiet)) == []


def test_a_mixture_of_experts_reads_the_union_of_the_pass_once(
    tiny_model: MakeTiny, open_engine: Callable[..., PrefillEngine]
) -> None:
    """Routed experts: each prompt's own choice read alone; the pass reads the union once."""
    path = tiny_model(arch="qwen3_moe", layers=4, experts=16, top_k=2)
    index = load_index(path)
    engine = open_engine(path, budget=sum(index.layer_bytes(i) for i in range(4)) // 6)
    # always wait for the routers (by default the streamer may read every expert where
    # waiting does not pay, a call that depends on this machine's timing)
    engine.route_experts = "always"
    short = [[3, 9], [400, 77]]  # two tokens each: few experts, different ones
    lone = []
    chosen: list[dict[int, int]] = []
    for p in short:
        lone.append(_lone(engine, p))
        chosen.append(dict(engine.last_stats.experts_streamed))
    asks = [Ask(p) for p in short]
    got: list[list[dict[str, torch.Tensor]]] = [[] for _ in short]
    for i, item in engine.prefill_pass(asks):
        got[i].append(_tensors(item))
    for mine, want in zip(got, lone, strict=True):
        _assert_same(mine, want)
    both = engine.last_stats.experts_streamed
    assert both, "no layer's experts were routed"
    for layer, n in both.items():
        assert max(c.get(layer, 0) for c in chosen) <= n <= sum(c.get(layer, 0) for c in chosen)
