"""The prefill node's prefix cache: K/V of recent prompts in host memory, keyed by tokens.

A follow-up turn asks for positions `start..n-2`; what this node still holds of `0..n-2` it
reuses, the rest it recomputes — so the answer is exact either way (`reusing` splices the
two). Bounded by bytes, least recently used first.

A model with linear layers (Qwen3.5): a linear layer's state stands at the end of the prompt
it was stored with and cannot be cut back, so an entry serves only a prompt that extends it
whole (a snapshot at the end of each prompt); an entry it extends is kept beside it, for a
later turn that edits inside the newer one (`exact_hits` counts the lookups that took an
entry whole for this reason, `misses` those that found none).

On CUDA (`use_arena`) the entries live in pinned memory, up to `max_bytes` (`PrefixArena`),
copied there layer by layer as a pass finishes them (`keep`), so that a later request's prefix
uploads from the cache as it lies. A pass holds the entries it reads (`lookup(hold=True)`)
until it is done with them: no entry's memory is handed out again under an upload. A layer
that finds no room (the rest held) stays in pageable memory, and is pinned per upload as
before; on a CPU nothing is copied.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import replace

import torch
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.prefix import best_prefix, common_prefix
from tandem.nodes.prefill.batch import Ask
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import Handed, LayerKV, LinearState, quantized_parts
from tandem.nodes.prefill.prefix_upload import Prefix
from tandem.nodes.prefill.serving.prefix_arena import PrefixArena

# per layer: K, V [1, n_kv, T, D] on the host, or a linear layer's state after T positions
KV = list[Prefix]
DEFAULT_MAX_BYTES = 1024**3


def _nbytes(entry: Prefix) -> int:
    tensors = entry.values() if isinstance(entry, dict) else entry
    return sum(t.nbytes for t in tensors)


def _named(entry: Prefix) -> dict[str, torch.Tensor]:
    return entry if isinstance(entry, dict) else {"k": entry[0], "v": entry[1]}


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
        self.arena: PrefixArena | None = None
        # entries held by the passes that read them, by the entry's id (its memory is not
        # handed out again before they are done); the lookups' K/V → the entry each came from
        self._held: Counter[int] = Counter()
        self._holds: dict[int, KV] = {}
        self._gone: dict[int, KV] = {}  # entries dropped while held: freed on release

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._entries.values())

    def use_arena(self, pin: bool = True) -> None:
        """Keep entries from here on in an arena of `max_bytes` (made once; `pin`: its blocks
        registered with CUDA as it takes them, so uploads copy from it as it lies)."""
        if self.arena is None:
            self.arena = PrefixArena(self.max_bytes, pin)

    def lookup(self, tokens: Sequence[int], hold: bool = False) -> tuple[int, KV | None]:
        """(j, per-layer K/V of positions 0..j-1) for the longest stored prefix, j < len.
        `hold`: the entry's memory stays as it is until `release` of what this returns."""
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
            cut = [_cut(entry, best_j) for entry in kv]
            if hold and self.arena is not None:
                self._held[id(kv)] += 1
                self._holds[id(cut)] = kv
        return best_j, cut

    def release(self, cut: KV | None) -> None:
        """A held lookup's entry is free to go again (its pass is done reading it)."""
        with self._lock:
            kv = self._holds.pop(id(cut), None)
            if kv is None:
                return
            self._held[id(kv)] -= 1
            if not self._held[id(kv)]:
                del self._held[id(kv)]
                if id(kv) in self._gone:
                    self._free(self._gone.pop(id(kv)))

    def keep(self, entry: Prefix, before: KV) -> Prefix:
        """`entry`, a layer of K/V or state a pass just finished, for a request whose layers
        so far are `before`: copied into the arena where the cache has one and the request
        can still be stored (making room by dropping the least recently used entries no
        pass holds), else as it is."""
        if self.arena is None or sum(map(_nbytes, [*before, entry])) > self.max_bytes:
            return entry
        with self._lock:
            return self._placed(entry, evict=True) or entry

    def store(self, tokens: Sequence[int], kv: KV) -> None:
        """A request's K/V or states of every layer, for later requests its tokens start (its
        layers in the arena where `keep` placed them; any it found no room for are moved
        there now, where dropping the entries it supersedes made room)."""
        nbytes = sum(_nbytes(entry) for entry in kv)
        key = tuple(tokens)
        with self._lock:
            if nbytes > self.max_bytes:
                self._free(kv)
                return
            for other in list(self._entries):  # made redundant: a prefix this one cuts to
                if other == key or (key[: len(other)] == other and not _has_state(kv)):
                    self._discard(other)
            while self._entries and self.nbytes + nbytes > self.max_bytes:
                self._discard(next(iter(self._entries)))  # least recently used first
            if self.arena is not None:
                kv = [e if self._piece(e) is not None else self._placed(e) or e for e in kv]
            self._entries[key] = (kv, nbytes)

    def drop(self, kv: KV) -> None:
        """What `keep` placed of a request that will not be stored (its pass ended first)."""
        with self._lock:
            self._free(kv)

    def _placed(self, entry: Prefix, evict: bool = False) -> Prefix | None:
        assert self.arena is not None
        while (placed := self.arena.place(_named(entry))) is None:
            free = [k for k, (kv, _) in self._entries.items() if id(kv) not in self._held]
            if not evict or not free:
                return None
            self._discard(free[0])
        return placed if isinstance(entry, dict) else (placed["k"], placed["v"])

    def _piece(self, entry: Prefix) -> int | None:
        first = next(iter(_named(entry).values()))
        return self.arena.piece_of(first) if self.arena is not None else None

    def _discard(self, key: tuple[int, ...]) -> None:
        kv, _ = self._entries.pop(key)
        if id(kv) in self._held:
            self._gone[id(kv)] = kv
        else:
            self._free(kv)

    def _free(self, kv: KV) -> None:
        for entry in kv:
            if (at := self._piece(entry)) is not None:
                self.arena.free(at)  # type: ignore[union-attr]


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
    if engine.device.type == "cuda":
        cache.use_arena(pin=True)  # once: cached prefixes upload from pinned memory
    hits = [cache.lookup(req.tokens, hold=True) for req in reqs]
    asks = [
        Ask(req.tokens[j:], j, prefix, req.request_id, req.kv_format)
        for req, (j, prefix) in zip(reqs, hits, strict=True)
    ]
    for ask, gone in zip(asks, dropped or (), strict=False):
        ask.dropped = gone
    layers = engine.prefill_pass(asks)
    full: list[KV] = [[] for _ in reqs]
    stored = [False] * len(reqs)
    try:
        for i, layer in layers:
            entry, sent = _spliced(engine, layer, hits[i], reqs[i])
            full[i].append(cache.keep(entry, full[i]))  # the cache keeps full precision
            if len(full[i]) == engine.spec.num_layers:
                # its last layer is handed over, so its compute, which waited on every
                # upload of its prefix, is done: the prefix may go
                cache.release(hits[i][1])
                cache.store(reqs[i].tokens, full[i])
                stored[i] = True
            yield i, sent
    finally:
        layers.close()
        left = [(hits[i][1], full[i]) for i, done in enumerate(stored) if not done]
        _let_go(engine, cache, left)
    return [len(req.tokens) - j for req, (j, _) in zip(reqs, hits, strict=True)]


def _let_go(engine: PrefillEngine, cache: PrefixCache, left: list[tuple[KV | None, KV]]) -> None:
    """After a pass, for each request it did not finish: (the prefix it held, the layers it
    placed) given back to the cache, once the device is done with them (a cancelled request's
    uploads may still be in flight)."""
    if not left or cache.arena is None:
        return
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    for prefix, kv in left:
        cache.release(prefix)
        cache.drop(kv)


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
