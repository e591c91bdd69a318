"""The decode node's prompt cache: each conversation's KV, reused by the next turn.

Entries are keyed by the token ids their caches hold. A request takes a *copy* of the
longest common prefix (slicing makes new arrays, so the stored entry is never touched), and
only the positions after it need a prefill — remote (`start = k`) or local. Bounded by bytes;
the least recently used conversation goes first (conversations are not a cyclic scan).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from nodes.contract import KVFormat
from nodes.decode import kv
from nodes.prefix import best_prefix

DEFAULT_MAX_BYTES = 2 * 1024**3


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    caches: kv.Caches
    nbytes: int
    kv_format: KVFormat | None  # a request reuses only caches held as it asks


class PromptCache:
    """Caches of past prompts (+ replies), by token prefix; thread-safe, bounded by bytes."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = 64) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def lookup(
        self, tokens: Sequence[int], kv_format: KVFormat | None = None
    ) -> tuple[int, kv.Caches | None]:
        """(k, caches holding 0..k-1) for the longest stored prefix of `tokens[:-1]`.

        At most n-1 positions are reused: the last prompt token must be fed to decode.
        """
        limit = len(tokens) - 1
        with self._lock:
            held = {key: e for key, e in self._entries.items() if _same(e.kv_format, kv_format)}
            best, best_k = best_prefix(held, tokens, limit)
            if best is None:
                return 0, None
            self._entries.move_to_end(best)
            entry = self._entries[best]
        return best_k, kv.clone_prefix(entry.caches, best_k)

    def store(self, tokens: Sequence[int], caches: kv.Caches) -> None:
        """Keep `caches` (holding exactly `tokens`), dropping entries it makes redundant."""
        key = tuple(tokens)
        if not key or kv.positions(caches) != len(key):
            return
        nbytes = kv.nbytes(caches)
        kv_format = kv.format_of(caches)
        with self._lock:
            for other in list(self._entries):
                if key[: len(other)] == other:  # a shorter prefix of this one
                    del self._entries[other]
            self._entries[key] = _Entry(key, caches, nbytes, kv_format)
            while self._entries and (
                self.nbytes > self.max_bytes or len(self._entries) > self.max_entries
            ):
                self._entries.popitem(last=False)


def _same(a: KVFormat | None, b: KVFormat | None) -> bool:
    """Whether caches held as `a` serve a request for `b` (the rounding kernel aside)."""
    return (a is None) == (b is None) and (
        a is None or b is None or (a.bits, a.group_size) == (b.bits, b.group_size)
    )
