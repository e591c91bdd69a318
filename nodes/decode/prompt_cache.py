"""The decode node's prompt cache: each conversation's KV, reused by the next turn.

Entries are keyed by the token ids their caches hold and the form they hold them in (full
precision, or quantized with given bits and group size): a request reuses only an entry of
the form it asks for, and storing one drops only entries of its own form. A request takes a
*copy* of the longest common prefix (slicing makes new arrays, so the stored entry is never
touched), and only the positions after it need a prefill — remote (`start = k`) or local.
Bounded by bytes; the least recently used conversation goes first (conversations are not a
cyclic scan).

A model with sliding-window layers: a window that has dropped positions cannot be cut back
(mlx-lm's `RotatingKVCache`), so an entry serves a turn that extends it whole, and a turn
that edits inside it falls back to the longest point held exactly (earlier turns' entries
are kept for that while their caches cannot be cut back to them; `fallbacks` counts it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.nodes.contract.http import KVFormat
from tandem.nodes.contract.prefix import best_prefix, common_prefix
from tandem.nodes.decode import lm

DEFAULT_MAX_BYTES = 2 * 1024**3


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    caches: lm.Caches
    nbytes: int
    kv_format: KVFormat | None  # a request reuses only caches held as it asks


class PromptCache:
    """Caches of past prompts (+ replies), by token prefix; thread-safe, bounded by bytes."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = 64) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[_Form, tuple[int, ...]], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.fallbacks = 0  # lookups that fell back from a window to a point held exactly

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def lookup(
        self, tokens: Sequence[int], kv_format: KVFormat | None = None
    ) -> tuple[int, lm.Caches | None]:
        """(k, caches holding 0..k-1) for the longest stored prefix of `tokens[:-1]`.

        At most n-1 positions are reused: the last prompt token must be fed to decode.
        """
        limit = len(tokens) - 1
        form = _form(kv_format)
        with self._lock:
            held = {key: e for (f, key), e in self._entries.items() if f == form}
            best, best_k = best_prefix(held, tokens, limit)
            if best is not None and not lm.can_cut(held[best].caches, best_k):
                # a window past its size cannot be cut back: the longest point held exactly
                exact = [k for k in held if len(k) <= limit and common_prefix(k, tokens) == len(k)]
                best = max(exact, key=len, default=None)
                best_k = len(best) if best is not None else 0
                self.fallbacks += 1
            if best is None or not best_k:
                return 0, None
            self._entries.move_to_end((form, best))
            entry = held[best]
        return best_k, lm.clone_prefix(entry.caches, best_k)

    def store(self, tokens: Sequence[int], caches: lm.Caches) -> None:
        """Keep `caches` (holding exactly `tokens`), dropping entries it makes redundant."""
        key = tuple(tokens)
        if not key or lm.positions(caches) != len(key):
            return
        nbytes = lm.nbytes(caches)
        kv_format = lm.format_of(caches)
        form = _form(kv_format)
        with self._lock:
            for f, other in list(self._entries):
                # a shorter prefix of this one, which these caches can be cut back to
                if f == form and key[: len(other)] == other and lm.can_cut(caches, len(other)):
                    del self._entries[f, other]
            self._entries[form, key] = _Entry(key, caches, nbytes, kv_format)
            while self._entries and (
                self.nbytes > self.max_bytes or len(self._entries) > self.max_entries
            ):
                self._entries.popitem(last=False)


_Form = tuple[int, int] | None  # (bits, group size) of quantized caches; None: full precision


def _form(kv_format: KVFormat | None) -> _Form:
    """What caches held as `kv_format` serve (the rounding kernel aside)."""
    return None if kv_format is None else (kv_format.bits, kv_format.group_size)
