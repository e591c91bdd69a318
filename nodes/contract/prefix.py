"""Longest shared token prefix: how the decode node's prompt cache and the prefill node's
prefix cache find what they can reuse (stdlib only: both sides import it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def best_prefix(
    keys: Iterable[tuple[int, ...]], tokens: Sequence[int], limit: int
) -> tuple[tuple[int, ...] | None, int]:
    """(the key sharing the longest prefix with `tokens`, that length capped at `limit`)."""
    best, best_k = None, 0
    for key in keys:
        k = min(common_prefix(key, tokens), limit)
        if k > best_k:
            best, best_k = key, k
    return best, best_k
