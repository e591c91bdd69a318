"""Gemma 3 (`gemma3_text`) on the prefill engine against mlx-lm's own prefill, the oracle:
sliding-window and global layers, prompts shorter and longer than the window, at a budget
that holds the model, a quarter of it and less than one layer, and after a prefix.

A made model: 6 layers, every 3rd global, a window of 8 positions, 7-token query chunks
(several per window). All on CPU; skipped without mlx-lm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import LayerKV
from tandem.nodes.prefill.kernels import blocks

from tests.conftest import MakeTiny
from tests.test_prefill_engine import engine_opener, greedy

WINDOW = 8
CHUNK = 7  # tokens: query chunks that start and end inside a window
SHORT, LONG = 6, 30  # prompt lengths: within the window, and several windows
STEPS = 8  # greedy tokens compared with mlx-lm


def gemma3_args(**extra: object) -> dict[str, object]:
    return {"arch": "gemma3", "layers": 6, "sliding_window": WINDOW, "sliding_window_pattern": 3,
            "shards": 2, **extra}  # fmt: skip


def prompt(n: int) -> list[int]:
    return np.random.default_rng(n).integers(0, 512, n).tolist()


def quarter(index: ModelIndex) -> int:
    return sum(index.layer_bytes(i) for i in range(index.spec.num_layers)) // 4


def half_layer(index: ModelIndex) -> int:
    return index.layer_bytes(0) // 2


BUDGETS: dict[str, Callable[[ModelIndex], int | None]] = {
    "whole": lambda index: None,  # the engine's default: every layer resident
    "quarter": quarter,
    "half_layer": half_layer,
}


@pytest.fixture(scope="module")
def gemma3_dir(tiny_model: MakeTiny) -> Path:
    return tiny_model(**gemma3_args())


@pytest.fixture(scope="module")
def mlx_model(gemma3_dir: Path) -> Any:
    pytest.importorskip("mlx_lm")
    import mlx_lm

    model, _ = mlx_lm.load(str(gemma3_dir))
    return model


@pytest.fixture
def open_engine() -> Iterator[Callable[..., PrefillEngine]]:
    """`open_engine(dir, budget=...)`: a CPU engine of CHUNK-token chunks, closed after it."""
    yield from engine_opener(CHUNK)


def mlx_prefill(model: Any, *calls: Sequence[int]) -> list[Any]:
    """mlx-lm's caches after prefilling `calls` one after the other."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for tokens in calls:
        model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def held(cache: Any) -> tuple[range, np.ndarray, np.ndarray]:
    """The positions a cache holds and their K, V [1, n_kv, len, D], in position order. A
    `RotatingKVCache` right after a prefill call holds its positions in order (the last
    window - 1 of earlier calls, then all of this call's); a `KVCache` all, in a larger
    buffer."""
    from mlx_lm.models.cache import RotatingKVCache

    n = cache.keys.shape[2] if isinstance(cache, RotatingKVCache) else cache.offset
    k, v = np.array(cache.keys[..., :n, :]), np.array(cache.values[..., :n, :])
    return range(cache.offset - n, cache.offset), k, v


def assert_matches(kv: Sequence[LayerKV], cache: list[Any], start: int = 0) -> None:
    """Our K/V of positions start.. equal mlx-lm's wherever its cache holds them."""
    from mlx_lm.models.cache import RotatingKVCache

    for layer, c in zip(kv, cache, strict=True):
        sliding = isinstance(c, RotatingKVCache)
        assert sliding == (layer.layer % 3 != 2)  # every 3rd layer global
        positions, k, v = held(c)
        lo = max(start, positions.start)
        ours = slice(lo - start, positions.stop - start)
        theirs = slice(lo - positions.start, None)
        assert lo < positions.stop
        for a, b in ((layer.k, k), (layer.v, v)):
            np.testing.assert_allclose(a[:, :, ours].numpy(), b[:, :, theirs], rtol=0, atol=1e-4,
                                       err_msg=f"layer {layer.layer}")  # fmt: skip


@pytest.mark.parametrize("budget_name", list(BUDGETS))
@pytest.mark.parametrize("n", [SHORT, LONG])
def test_matches_mlx_lm(
    n: int, budget_name: str, gemma3_dir: Path, mlx_model: Any,
    open_engine: Callable[..., PrefillEngine],
) -> None:  # fmt: skip
    index = load_index(gemma3_dir)
    engine = open_engine(gemma3_dir, budget=BUDGETS[budget_name](index))
    if budget_name == "half_layer":  # really below a layer: its ops cut into row ranges
        assert engine.plan.cuts_ops
    tokens = prompt(n)
    kv = list(engine.prefill(tokens))
    assert [layer.layer for layer in kv] == list(range(6))
    for layer in kv:  # every new position, sliding layers too (the window cut comes later)
        assert layer.k.shape == (1, index.spec.num_kv_heads, n, index.spec.head_dim)
    assert_matches(kv, mlx_prefill(mlx_model, tokens))


def test_after_a_prefix(
    gemma3_dir: Path, mlx_model: Any, open_engine: Callable[..., PrefillEngine]
) -> None:
    """The second half after the first's K/V, against mlx-lm prefilling in the same two
    calls (its sliding caches then hold only the window)."""
    tokens, k = prompt(LONG), 13
    engine = open_engine(gemma3_dir, budget=quarter(load_index(gemma3_dir)))
    first = list(engine.prefill(tokens[:k]))
    prefix = [(layer.k, layer.v) for layer in first]
    rest = list(engine.prefill(tokens[k:], start=k, prefix=prefix))
    cache = mlx_prefill(mlx_model, tokens[:k], tokens[k:])
    assert held(cache[0])[0] == range(k - WINDOW + 1, LONG)  # the window, really
    assert_matches(rest, cache, start=k)


def test_decode_continues_from_our_kv(
    gemma3_dir: Path, mlx_model: Any, open_engine: Callable[..., PrefillEngine]
) -> None:
    """mlx-lm's own caches (rotating on sliding layers) filled with our K/V, one call as a
    prefill fills them, give mlx-lm's greedy tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    tokens = prompt(LONG)
    engine = open_engine(gemma3_dir, budget=half_layer(load_index(gemma3_dir)))
    caches: list[Any] = []
    for layer, kind in zip(engine.prefill(tokens[:-1]), engine.spec.layer_kinds, strict=True):
        cache = KVCache() if kind.window is None else RotatingKVCache(max_size=kind.window)
        cache.update_and_fetch(mx.array(layer.k.numpy()), mx.array(layer.v.numpy()))
        caches.append(cache)
    assert greedy(mlx_model, tokens[-1:], caches, STEPS) == greedy(mlx_model, tokens, None, STEPS)


def test_sliding_attention_masks_one_chunk_at_a_time(
    gemma3_dir: Path, open_engine: Callable[..., PrefillEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No [T, S] mask for the prompt: a band per query chunk over its window's keys only, the
    same K/V in chunks of 7 as in one chunk of 64."""
    shapes: list[tuple[int, ...]] = []
    band = blocks.band_mask

    def recording(*args: Any) -> torch.Tensor:
        mask = band(*args)
        shapes.append(tuple(mask.shape))
        return mask

    monkeypatch.setattr(blocks, "band_mask", recording)
    tokens = prompt(LONG)
    chunked = list(open_engine(gemma3_dir, chunk_tokens=CHUNK).prefill(tokens))
    assert shapes and all(q <= CHUNK and k <= CHUNK + WINDOW - 1 for q, k in shapes)
    shapes.clear()
    whole = list(open_engine(gemma3_dir, chunk_tokens=64).prefill(tokens))
    assert shapes and all(k == LONG for _, k in shapes)  # one chunk: the keys are all
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a.k, b.k, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.v, b.v, rtol=0, atol=1e-5)


def test_made_model_matches_transformers(gemma3_dir: Path, mlx_model: Any) -> None:
    """`make-model --arch gemma3` writes what transformers and mlx-lm read alike."""
    transformers = pytest.importorskip("transformers")
    import mlx.core as mx

    tokens = prompt(LONG)
    ours = np.array(mlx_model(mx.array([tokens]))[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_dir, dtype=torch.float32, attn_implementation="eager"
    )
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    with torch.inference_mode():
        theirs = hf(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)


def test_quantized_matches_mlx_lm(
    tiny_model: MakeTiny, open_engine: Callable[..., PrefillEngine]
) -> None:
    """An MLX 4-bit checkpoint (embedding included: scaled after its rows are dequantized),
    below one layer's bytes."""
    pytest.importorskip("mlx_lm")
    import mlx_lm

    model_dir = tiny_model(**gemma3_args(intermediate=128, quantize=4))
    model, _ = mlx_lm.load(str(model_dir))
    tokens = prompt(LONG)
    # two thirds of a layer: half of this toy's 24 KB cannot also hold each piece's padding
    # to 256 bytes (loads.ALIGN) beside the slices' dequantized scratch
    engine = open_engine(model_dir, budget=load_index(model_dir).layer_bytes(0) * 2 // 3)
    assert engine.spec.quantization.quantized and engine.plan.granularity == "slice"
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(model, tokens))
