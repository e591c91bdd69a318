"""The prefill node's prefix cache: K/V of recent prompts in host memory, keyed by tokens.

A follow-up turn asks for positions `start..n-2`; what this node still holds of `0..n-2` it
reuses, the rest it recomputes — so the answer is exact either way. Bounded by bytes, least
recently used first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
from tandem.nodes.contract.prefix import best_prefix

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [1, n_kv, T, D] on the host
DEFAULT_MAX_BYTES = 1024**3


class PrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[KV, int]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._entries.values())

    def lookup(self, tokens: Sequence[int]) -> tuple[int, KV | None]:
        """(j, per-layer K/V of positions 0..j-1) for the longest stored prefix, j < len."""
        limit = len(tokens) - 1  # always compute at least one position
        with self._lock:
            best, best_j = best_prefix(self._entries, tokens, limit)
            if best is None:
                return 0, None
            self._entries.move_to_end(best)
            kv, _ = self._entries[best]
        return best_j, [(k[:, :, :best_j], v[:, :, :best_j]) for k, v in kv]

    def store(self, tokens: Sequence[int], kv: KV) -> None:
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.max_bytes:
            return
        key = tuple(tokens)
        with self._lock:
            for other in list(self._entries):
                if key[: len(other)] == other:
                    del self._entries[other]
            self._entries[key] = (kv, nbytes)
            while self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)
