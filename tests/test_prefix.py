"""The shared-prefix helpers and the prefill node's prefix cache."""

from __future__ import annotations

import torch
from tandem.nodes.contract.prefix import best_prefix, common_prefix
from tandem.nodes.prefill.serving.prefix_cache import PrefixCache


def test_common_and_best_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    keys = [(1, 2, 3), (1, 2, 3, 4, 5), (9,)]
    assert best_prefix(keys, [1, 2, 3, 4, 6], limit=10) == ((1, 2, 3, 4, 5), 4)
    assert best_prefix(keys, [1, 2, 3, 4, 6], limit=2) == ((1, 2, 3), 2)
    assert best_prefix(keys, [7], limit=10) == (None, 0)


def _kv(n: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, n, 4), float(i)), torch.full((1, 2, n, 4), -float(i)))
            for i in range(layers)]  # fmt: skip


def test_prefix_cache_reuses_the_longest_prefix_and_leaves_one_token() -> None:
    cache = PrefixCache()
    cache.store([1, 2, 3, 4], _kv(4))
    j, kv = cache.lookup([1, 2, 3, 4])
    assert j == 3 and kv is not None and kv[1][0].shape == (1, 2, 3, 4)  # always compute one
    j, kv = cache.lookup([1, 2, 9])
    assert j == 2 and kv is not None and torch.equal(kv[1][1], torch.full((1, 2, 2, 4), -1.0))
    assert cache.lookup([5, 6]) == (0, None)


def test_prefix_cache_is_bounded_and_drops_shorter_prefixes() -> None:
    one = sum(k.nbytes + v.nbytes for k, v in _kv(4))
    cache = PrefixCache(max_bytes=2 * one)
    cache.store([1, 2], _kv(2))
    cache.store([1, 2, 3, 4], _kv(4))  # supersedes [1, 2]
    assert cache.nbytes == one
    cache.store([7, 8, 9, 10], _kv(4))
    cache.store([5, 6, 7, 8], _kv(4))  # evicts the least recently used
    assert cache.nbytes <= 2 * one
    assert cache.lookup([1, 2, 3, 4, 5]) == (0, None)
