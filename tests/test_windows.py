"""A sliding layer's cache from its window alone (`lm.fill_window`), cut back (`lm.can_cut`,
`lm.clone_prefix`) and kept across turns (`PromptCache`), against mlx-lm's own
`RotatingKVCache` fed every position: after each next step both hold the same K/V."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from tandem.nodes.decode import lm
from tandem.nodes.decode.prompt_cache import PromptCache

W = 8  # the window
KV = (1, 2, 0, 4)  # [1, n_kv, positions, head_dim]


def positions(a: int, b: int) -> mx.array:
    """K (or V) of positions a..b-1: each position's values say which it is."""
    return mx.broadcast_to(mx.arange(a, b, dtype=mx.float32)[None, None, :, None], (1, 2, b - a, 4))


def mlx_own(chunks: list[int]) -> RotatingKVCache:
    """mlx-lm's cache after multi-token updates of these sizes (its prefill steps)."""
    cache, at = RotatingKVCache(max_size=W), 0
    for n in chunks:
        cache.update_and_fetch(positions(at, at + n), positions(at, at + n))
        at += n
    return cache


def step(cache: RotatingKVCache) -> list[float]:
    """The positions the next token attends to, after it is put in."""
    at = cache.offset
    keys, _ = cache.update_and_fetch(positions(at, at + 1), positions(at, at + 1))
    return sorted(keys[0, 0, :, 0].tolist())


@pytest.mark.parametrize(("prompt", "chunks"), [(5, [5]), (8, [8]), (30, [30]), (30, [20, 10])])
def test_the_window_alone_fills_the_cache_mlx_lm_fills_with_every_position(
    prompt: int, chunks: list[int]
) -> None:
    w = min(prompt, W)
    ours = lm.fill_window(RotatingKVCache(max_size=W), *[positions(prompt - w, prompt)] * 2, prompt)
    theirs = mlx_own(chunks)
    assert lm.size(ours) == lm.size(theirs) == prompt
    for _ in range(W + 2):  # past a rotation
        assert step(ours) == step(theirs)


@pytest.mark.parametrize(("before", "new"), [(3, 2), (6, 5), (20, 3), (20, 12)])
def test_a_window_after_a_cached_prefix_is_what_one_more_update_makes(
    before: int, new: int
) -> None:
    cached = mlx_own([before])
    step(cached)  # a decode step first: a rotated cache for a long prefix
    start = before + 1
    w = min(new, W)
    ours = lm.fill_window(cached, *[positions(start + new - w, start + new)] * 2, start + new)
    theirs = mlx_own([before])
    step(theirs)
    theirs.update_and_fetch(positions(start, start + new), positions(start, start + new))
    assert lm.size(ours) == lm.size(theirs) == start + new
    for _ in range(3):
        assert step(ours) == step(theirs)


def test_a_gap_before_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="not in the cache"):
        lm.fill_window(RotatingKVCache(max_size=W), *[positions(10, 13)] * 2, 13)


def test_a_window_is_cut_back_only_while_it_has_dropped_nothing() -> None:
    short, long = [mlx_own([6])], [mlx_own([20])]
    assert lm.can_cut(short, 3) and lm.can_cut(long, 20) and not lm.can_cut(long, 12)
    cut = lm.clone_prefix(short, 3)[0]
    assert lm.size(cut) == 3 and step(cut) == [0.0, 1.0, 2.0, 3.0]
    whole = lm.clone_prefix(long, 20)[0]
    assert step(whole) == step(long[0])  # a copy: the original steps on as before
    with pytest.raises(ValueError, match="cannot be cut back"):
        lm.clone_prefix(long, 12)


def test_the_prompt_cache_falls_back_to_a_point_held_exactly() -> None:
    def caches(n: int) -> lm.Caches:
        full = KVCache()
        full.update_and_fetch(positions(0, n), positions(0, n))
        return [mlx_own([n]), full]

    cache = PromptCache()
    turn1, turn2 = list(range(20)), list(range(40))
    cache.store(turn1, caches(20))
    cache.store(turn2, caches(40))  # turn one stays: the windows cannot be cut back to it
    k, got = cache.lookup([*turn2, 99])
    assert k == 40 and got is not None and cache.fallbacks == 0
    edited = [*range(30), -1, *range(31, 45)]  # an edit inside turn two
    k, got = cache.lookup(edited)
    assert k == 20 and cache.fallbacks == 1
    assert got is not None and [lm.size(c) for c in got] == [20, 20]
    assert cache.lookup([-1, 1, 2]) == (0, None)
