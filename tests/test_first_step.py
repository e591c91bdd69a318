"""The last prompt token's pass run a layer at a time (nodes/decode/families/llama.py) is the
model's own step, bit for bit: the same logits and the same caches as `model(token, cache)`,
for every architecture and form the decode node loads, and on quantized caches."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from tandem.nodes.decode.families.llama import FirstStep

from tests.conftest import MakeTiny

CASES: dict[str, tuple[dict[str, Any], int | None]] = {
    "llama": ({"arch": "llama", "layers": 3}, None),
    "qwen3": ({"arch": "qwen3", "layers": 2}, None),
    "qwen2": ({"arch": "qwen2", "layers": 2}, None),
    "glm4_moe": ({"arch": "glm4_moe", "layers": 2}, None),  # its MLP routes
    "tied": ({"arch": "llama", "layers": 2, "tie_embeddings": True}, None),
    "bf16": ({"arch": "llama", "layers": 2, "dtype": "bfloat16"}, None),
    "mlx-q4": (
        {"arch": "llama", "layers": 2, "quantize": 4, "group_size": 32, "intermediate": 192},
        None,
    ),
    "kv8": ({"arch": "llama", "layers": 2, "head_dim": 64}, 8),
    "kv4": ({"arch": "llama", "layers": 2, "head_dim": 64}, 4),
}
PROMPT = [(7 * i + 3) % 500 for i in range(70)]
LAST = 123


def _prefilled(model: Any, kv_bits: int | None) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    if kv_bits is not None:  # as the decode node builds it from quantized frames
        cache = [c.to_quantized(group_size=64, bits=kv_bits) for c in cache]
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_at_a_time_is_the_models_own_step(tiny_model: MakeTiny, case: str) -> None:
    args, kv_bits = CASES[case]
    model, _ = load(str(tiny_model(**args)))
    want_cache = _prefilled(model, kv_bits)
    want = model(mx.array([[LAST]]), cache=want_cache)[:, -1, :]

    cache = _prefilled(model, kv_bits)
    step = FirstStep.for_model(model, LAST, cache)
    assert step is not None
    for layer in range(len(cache)):
        assert not step.complete
        step.advance(layer)
    got = step.logits()
    assert mx.array_equal(got, want).item()
    for a, b in zip(cache, want_cache, strict=True):
        assert a.offset == b.offset == len(PROMPT) + 1
        for x, y in zip(tree_flatten(a.state), tree_flatten(b.state), strict=True):
            assert mx.array_equal(x[1], y[1]).item()


def test_layers_run_in_order_and_all_before_the_logits(tiny_model: MakeTiny) -> None:
    model, _ = load(str(tiny_model(arch="llama", layers=2)))
    step = FirstStep.for_model(model, LAST, _prefilled(model, None))
    assert step is not None
    with pytest.raises(ValueError, match="layer 1 before layer 0"):
        step.advance(1)
    step.advance(0)
    with pytest.raises(ValueError, match="1 of 2 layers"):
        step.logits()


def test_an_unknown_structure_gets_no_first_step(tiny_model: MakeTiny) -> None:
    model, _ = load(str(tiny_model(arch="llama", layers=2)))
    cache = _prefilled(model, None)
    assert FirstStep.for_model(model, LAST, cache[:1]) is None  # caches for other layers

    class Wrapped:  # no `.model.layers`: the decode node runs the step whole
        def __call__(self, *a: Any, **k: Any) -> Any:
            return model(*a, **k)

    assert FirstStep.for_model(Wrapped(), LAST, cache) is None
