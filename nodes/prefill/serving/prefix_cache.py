"""The prefill node's prefix cache: K/V of recent prompts in host memory, keyed by tokens.

A follow-up turn asks for positions `start..n-2`; what this node still holds of `0..n-2` it
reuses, the rest it recomputes — so the answer is exact either way (`reusing` splices the
two). Bounded by bytes, least recently used first.

A model with linear layers (Qwen3.5): a linear layer's state stands at the end of the prompt
it was stored with and cannot be cut back, so an entry serves only a prompt that extends it
whole (a snapshot at the end of each prompt); an entry it extends is kept beside it, for a
later turn that edits inside the newer one (`exact_hits` counts the lookups that took an
entry whole for this reason, `misses` those that found none).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import replace

import torch
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.prefix import best_prefix, common_prefix
from tandem.nodes.prefill.batch import Ask
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import Handed, LayerKV, LinearState, quantized_parts
from tandem.nodes.prefill.prefix_upload import Prefix

# per layer: K, V [1, n_kv, T, D] on the host, or a linear layer's state after T positions
KV = list[Prefix]
DEFAULT_MAX_BYTES = 1024**3


def _nbytes(entry: Prefix) -> int:
    tensors = entry.values() if isinstance(entry, dict) else entry
    return sum(t.nbytes for t in tensors)


def _cut(entry: Prefix, j: int) -> Prefix:
    """Layer K/V of positions 0..j-1 (a state only where it stands: the caller saw to it)."""
    if isinstance(entry, dict):
        return entry
    k, v = entry
    return k[:, :, :j], v[:, :, :j]


class PrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[KV, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.exact_hits = 0  # lookups a linear layer's state held to an entry's end
        self.misses = 0  # lookups that found nothing to reuse

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._entries.values())

    def lookup(self, tokens: Sequence[int]) -> tuple[int, KV | None]:
        """(j, per-layer K/V of positions 0..j-1) for the longest stored prefix, j < len."""
        limit = len(tokens) - 1  # always compute at least one position
        with self._lock:
            best, best_j = best_prefix(self._entries, tokens, limit)
            if best is not None and best_j != len(best) and _has_state(self._entries[best][0]):
                whole = [k for k in self._entries if len(k) <= limit and
                         common_prefix(k, tokens) == len(k)]  # fmt: skip
                best = max(whole, key=len, default=None)
                best_j = len(best) if best is not None else 0
                self.exact_hits += best is not None
            if best is None or not best_j:
                self.misses += 1
                return 0, None
            self._entries.move_to_end(best)
            kv, _ = self._entries[best]
        return best_j, [_cut(entry, best_j) for entry in kv]

    def store(self, tokens: Sequence[int], kv: KV) -> None:
        nbytes = sum(_nbytes(entry) for entry in kv)
        if nbytes > self.max_bytes:
            return
        key = tuple(tokens)
        with self._lock:
            for other in list(self._entries):  # made redundant: a prefix this one cuts to
                if key[: len(other)] == other and not _has_state(kv):
                    del self._entries[other]
            self._entries[key] = (kv, nbytes)
            while self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)


def _has_state(kv: KV) -> bool:
    return any(isinstance(entry, dict) for entry in kv)


def reusing(
    engine: PrefillEngine, cache: PrefixCache, req: PrefillBody
) -> Generator[Handed, None, int]:
    """On the device thread: each layer's positions req.start.. as the engine finishes it
    (`reusing_pass` for one request). Returns the positions computed (not reused)."""
    one = reusing_pass(engine, cache, [req])
    try:
        while True:
            _, item = next(one)
            yield item
    except StopIteration as done:
        return done.value[0]
    finally:
        one.close()


def reusing_pass(
    engine: PrefillEngine,
    cache: PrefixCache,
    reqs: Sequence[PrefillBody],
    dropped: Sequence[threading.Event] | None = None,
) -> Generator[tuple[int, Handed], None, list[int]]:
    """On the device thread: one pass of the weights for every request (`prefill_pass`),
    yielding (the request's place, one layer of its positions req.start..) as the engine
    finishes it: the cache's longest hit 0..j-1 for each reused and spliced in front of what
    the engine computes (j..n-1), each request's whole K/V stored for its next turn once its
    every layer is done. `dropped[i]`: request i's reader is gone (the pass skips it).
    Returns the positions computed (not reused) per request."""
    hits = [cache.lookup(req.tokens) for req in reqs]
    asks = [
        Ask(req.tokens[j:], j, prefix, req.request_id, req.kv_format)
        for req, (j, prefix) in zip(reqs, hits, strict=True)
    ]
    for ask, gone in zip(asks, dropped or (), strict=False):
        ask.dropped = gone
    layers = engine.prefill_pass(asks)
    full: list[KV] = [[] for _ in reqs]
    try:
        for i, layer in layers:
            entry, sent = _spliced(engine, layer, hits[i], reqs[i])
            full[i].append(entry)  # the cache keeps full precision
            if len(full[i]) == engine.spec.num_layers:
                cache.store(reqs[i].tokens, full[i])
            yield i, sent
    finally:
        layers.close()
    return [len(req.tokens) - j for req, (j, _) in zip(reqs, hits, strict=True)]


def _spliced(
    engine: PrefillEngine, layer: Handed, hit: tuple[int, KV | None], req: PrefillBody
) -> tuple[Prefix, Handed]:
    """(what the cache keeps of the layer: positions 0..n-1, what crosses the wire)."""
    if isinstance(layer, LinearState):  # its state after the prompt, whatever j
        return layer.tensors, layer
    j, prefix = hit
    k, v = layer.k, layer.v  # positions j..n-1
    if prefix is not None:
        pk, pv = prefix[layer.layer]  # type: ignore[misc]  # a full layer's
        k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
    window = engine.spec.layer_kinds[layer.layer].window
    if window is not None:  # a sliding layer: the positions its window keeps, float
        first = max(req.start, len(req.tokens) - window)
        return (k, v), LayerKV(layer.layer, k[:, :, first:], v[:, :, first:])
    sent = LayerKV(layer.layer, k[:, :, req.start :], v[:, :, req.start :])
    if req.kv_format is not None:
        sent = replace(sent, quantized=_sent_quantized(layer, prefix, j, req))
    return (k, v), sent


def _sent_quantized(
    layer: LayerKV, prefix: KV | None, j: int, req: PrefillBody
) -> dict[str, torch.Tensor]:
    """The quantized K/V of positions req.start.. : the engine's (positions j..) and, where
    the request starts inside the cache's hit, that part quantized here (groups run along
    head_dim, so quantizing a concatenation is concatenating the quantized parts)."""
    assert req.kv_format is not None and layer.quantized is not None
    computed = {n: t[:, :, max(0, req.start - j) :] for n, t in layer.quantized.items()}
    if prefix is None or req.start >= j:
        return computed
    pk, pv = prefix[layer.layer]  # type: ignore[misc]  # a full layer's
    head = quantized_parts(pk[:, :, req.start :], pv[:, :, req.start :], req.kv_format)
    return {n: torch.cat([head[n], computed[n]], dim=2) for n in computed}
