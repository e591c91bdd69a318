"""mlx-lm, seen from tandem: the one module of the request path that imports `mlx_lm` (the
token loop, `generate.py`, takes its samplers and processors from here).

Loading and the cache classes are reached here and nowhere else, written
against mlx-lm's public API wherever one exists: a cache's `state` (read and set), `offset`,
`update_and_fetch`, `trim`, `to_quantized`, `nbytes`; `make_prompt_cache` (a model's own
`make_cache()`, a mixed list for models whose layers differ); `generate_step`'s prompt loop.
tests/test_lm.py runs the generation beside `mlx_lm.stream_generate` on the same
cache, so an mlx-lm upgrade that moves one of these fails there first.

A layer's cache has a kind: `full` (every position's K/V: `KVCache`, or `QuantizedKVCache`
once quantized), `sliding` (a window of K/V: `RotatingKVCache`) or `linear` (a fixed-size
state: `ArraysCache`). Decode families (`families/`) fill each kind from a layer's frames.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx_lm import load as _load
from mlx_lm.generate import BatchGenerator, generation_stream, wired_limit
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from tandem.nodes.contract.http import KVFormat, KVKernel

Caches = list[Any]  # one mlx-lm cache per layer
CacheKind = Literal["full", "sliding", "linear", "other"]
PREFILL_STEP = 2048  # mlx-lm's prefill_step_size: same chunks, same numbers
STREAM = generation_stream  # mlx-lm's own stream for generation (thread-local)
Sampler = Callable[[mx.array], mx.array]  # log-probabilities [1, vocab] -> token [1]
Processor = Callable[[mx.array, mx.array], mx.array]  # (history [n], logits [1, vocab])


def load(model_dir: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) as mlx-lm loads them."""
    return _load(str(model_dir))


def wired(model: Any) -> AbstractContextManager[None]:
    """As `stream_generate` runs: on a Mac the weights stay wired in memory meanwhile."""
    return wired_limit(model, [STREAM])


GREEDY_BELOW = 1e-4  # a temperature this small is greedy (1e-300 overflowed the logits)


def sampler(temperature: float, top_p: float) -> Sampler:
    """mlx-lm's sampler for a request's temperature and top_p; greedy below GREEDY_BELOW
    (logits divided by a tiny temperature overflow to infinities, and sample at random)."""
    return make_sampler(temp=0.0 if temperature < GREEDY_BELOW else temperature, top_p=top_p)


def logits_processors(
    presence: float, frequency: float, bias: Sequence[tuple[int, float]]
) -> list[Processor]:
    """mlx-lm's logits processors for OpenAI's penalties and `logit_bias` (none for zeros),
    each over the last 20 tokens as mlx-lm's server has them."""
    return make_logits_processors(
        dict(bias) or None, presence_penalty=presence or None, frequency_penalty=frequency or None
    )


def new_caches(model: Any) -> Caches:
    """The model's own cache list (`make_cache()` where it has one: kinds may differ)."""
    return make_prompt_cache(model)


def vocab_size(model: Any) -> int:
    """The model's vocabulary (Qwen3.5's args keep it in `text_config`)."""
    args = model.args
    return int(getattr(args, "vocab_size", None) or args.text_config["vocab_size"])


def attention_mask(h: mx.array, cache: Any) -> Any:
    """The mask mlx-lm's models make for hidden states `h` [B, L, D] after `cache`."""
    return create_attention_mask(h, cache)


# ---------------------------------------------------------------- caches


def kind(cache: Any) -> CacheKind:
    if isinstance(cache, KVCache | QuantizedKVCache):
        return "full"
    if isinstance(cache, RotatingKVCache):
        return "sliding"
    if isinstance(cache, ArraysCache):
        return "linear"
    return "other"


def size(cache: Any) -> int:
    """Token positions a cache covers (a window's: every position it has seen, though it
    keeps only the last `max_size`)."""
    # QuantizedKVCache's `size()` says 0 in mlx-lm 0.32, a RotatingKVCache's the window it
    # keeps: `offset` is the count of both
    return cache.offset if isinstance(cache, QuantizedKVCache | RotatingKVCache) else cache.size()


def quantized_form(cache: Any) -> tuple[int, int] | None:
    """(bits, group size) of a quantized cache; None for any other."""
    if isinstance(cache, QuantizedKVCache):
        return cache.bits, cache.group_size
    return None


def to_quantized(cache: Any, kv_format: KVFormat) -> Any:
    """A float cache's positions quantized as mlx-lm does (`to_quantized`); a quantized one
    as it is."""
    if isinstance(cache, QuantizedKVCache):
        return cache
    return cache.to_quantized(group_size=kv_format.group_size, bits=kv_format.bits)


def quantize_when_due(caches: Caches, kv_format: KVFormat | None) -> None:
    """mlx-lm's own step: float caches become quantized (`quantized_kv_start=0`)."""
    if kv_format is None:
        return
    for i, c in enumerate(caches):  # `maybe_quantize_kv_cache(.., 0, ..)` on full layers only
        if type(c) is KVCache:  # mlx-lm cannot quantize a window's (nor need it: bounded)
            caches[i] = to_quantized(c, kv_format)
    if (mirror := _mirror(caches)) is not None:
        mirror.quantized(caches, kv_format)


def append(cache: Any, k: mx.array, v: mx.array) -> None:
    """Append float K, V [1, n_kv, count, D] to a float cache (full, or a sliding window's:
    one update, as mlx-lm's prefill makes it)."""
    cache.update_and_fetch(k, v)


def fill_window(cache: Any, k: mx.array, v: mx.array, end: int) -> Any:
    """A new `RotatingKVCache` like `cache` whose positions now run to `end`, the last of
    them K, V [1, n_kv, w, D] (w <= its window): the positions of `cache` before them that
    the window still reaches, then these. Its next step trims and rotates as mlx-lm's own
    does after a prefill (its state through the cache's `state`: keys, values, offset, keep,
    max_size, index in mlx-lm 0.32). `cache` stays as it was."""
    window, w = cache.max_size, k.shape[2]
    if w > window or end < cache.offset + w:
        raise ValueError(f"{w} positions to {end} after {cache.offset} in a window of {window}")
    if cache.keys is not None and w < window and end - w == cache.offset:
        old_k, old_v = (_in_order(cache, x)[..., -(window - w) :, :] for x in cache.state[:2])
        k, v = mx.concatenate([old_k, k], axis=2), mx.concatenate([old_v, v], axis=2)
    elif w < window and end != w:  # a gap before them, or positions the window needs lost
        raise ValueError(f"the window before position {end - w} is not in the cache")
    new = RotatingKVCache(max_size=window, keep=cache.keep)
    new.state = (k, v, end, cache.keep, window, k.shape[2])
    return new


def _in_order(cache: Any, x: mx.array) -> mx.array:
    """A rotating cache's K or V array as it holds them in use, oldest position first (the
    cache's own reordering, as its next multi-token update makes it)."""
    return cache._temporal_order(x)


def append_quantized(cache: Any, keys: Sequence[mx.array], values: Sequence[mx.array]) -> None:
    """Append already-quantized positions (words, scales, biases, each [1, n_kv, count, ·]) to
    a quantized cache, as its `update_and_fetch` would after quantizing them itself; through
    the cache's `state` (keys, values, offset, group size, bits in mlx-lm 0.32)."""
    old_k, old_v, prev, group, bits = cache.state
    if old_k is None:
        new_k, new_v = tuple(keys), tuple(values)
    else:
        new_k = tuple(_cat(old, x, prev) for old, x in zip(old_k, keys, strict=True))
        new_v = tuple(_cat(old, x, prev) for old, x in zip(old_v, values, strict=True))
    cache.state = (new_k, new_v, prev + keys[0].shape[2], group, bits)


def _cat(old: mx.array, new: mx.array, prev: int) -> mx.array:
    return mx.concatenate([old[..., :prev, :], new], axis=2)


def copy_prefix(cache: Any, k: int) -> Any:
    """A new full-attention cache of the same form holding positions 0..k-1 of `cache`
    (fresh arrays: the source stays as it is)."""
    form = quantized_form(cache)
    if form is not None:
        new = QuantizedKVCache(group_size=form[1], bits=form[0])
        if k:
            keys, values = cache.state[:2]
            append_quantized(new, [x[..., :k, :] for x in keys], [x[..., :k, :] for x in values])
        return new
    if kind(cache) == "sliding":
        return _copy_window(cache, k)
    if kind(cache) != "full":
        raise ValueError(f"a {type(cache).__name__} cannot be cut at a position")
    new = KVCache()
    if k:
        keys, values = cache.state[:2]
        new.update_and_fetch(keys[..., :k, :], values[..., :k, :])
    return new


def fill_state(cache: Any, arrays: Sequence[mx.array]) -> None:
    """Set a linear layer's state (`ArraysCache`): its slots in order (Qwen3.5: the conv
    state [1, K-1, conv_dim], the recurrent state [1, Hv, Dv, Dk] float32). Through the
    slots, not `state` (mlx-lm PR #1632 made `state` a tuple with padding fields)."""
    if len(arrays) != len(cache.cache):
        raise ValueError(f"{len(arrays)} state arrays for a cache of {len(cache.cache)}")
    for i, a in enumerate(arrays):
        cache[i] = a


def new_state_cache(slots: int) -> Any:
    """An empty linear-layer cache of `slots` arrays (`ArraysCache`)."""
    return ArraysCache(size=slots)


def _copy_state(cache: Any) -> Any:
    """A new linear-layer cache holding the same state (mlx arrays are never written in
    place: the layer's next step sets new ones)."""
    new = new_state_cache(len(cache.cache))
    fill_state(new, list(cache.cache))
    return new


def _copy_window(cache: Any, k: int) -> Any:
    """A new rotating cache holding what `cache` does at position k: all of it at its end,
    or, while it has dropped nothing, its first k positions."""
    if k != cache.offset and not (k < cache.offset <= cache.max_size):
        raise ValueError(f"a window at {cache.offset} cannot be cut back to position {k}")
    new = RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    if k:
        held = [_in_order(cache, x) for x in cache.state[:2]]
        cut = slice(0, k) if k < cache.offset else slice(-min(k, cache.max_size), None)
        keys, values = (x[..., cut, :] for x in held)
        new.state = (keys, values, k, cache.keep, cache.max_size, keys.shape[2])
    return new


def can_cut(caches: Caches, k: int) -> bool:
    """Whether `clone_prefix(caches, k)` can hold positions 0..k-1: a window that has
    dropped positions only at its end, a linear layer's state only where it is (it holds
    no positions one by one, so it cannot be cut back)."""
    if k != positions(caches) and has_state(caches):
        return False
    return all(kind(c) != "sliding" or k == c.offset or k < c.offset <= c.max_size for c in caches)


def has_state(caches: Caches) -> bool:
    """Whether some layer holds a state (linear attention), which cannot be cut back (a
    decode group's other ranks' layers too)."""
    return any(kind(c) == "linear" for c in caches) or "linear" in getattr(caches, "kinds", ())


def device_kernel() -> KVKernel:
    """Whose `mx.quantize` rounding this node's caches get: mlx's CPU kernel or its GPU one."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def format_of(caches: Caches) -> KVFormat | None:
    """The KV format the caches hold (None: full precision)."""
    forms = [quantized_form(c) for c in caches if kind(c) == "full"]
    form = forms[0] if forms else None  # windows stay float
    return KVFormat(form[0], form[1], device_kernel()) if form else None


def positions(caches: Caches) -> int:
    """Token positions the caches hold (every layer holds the same; a linear layer's state
    does not count them, so the first other layer's say)."""
    counted = [c for c in caches if kind(c) != "linear"]
    return size(counted[0]) if counted else 0


def nbytes(caches: Caches) -> int:
    return sum(c.nbytes for c in caches)


def clone_prefix(caches: Caches, k: int) -> Caches:
    """New caches holding positions 0..k-1 of `caches`, of the same form, evaluated (where
    `can_cut` says they can)."""
    if not can_cut(caches, k):
        raise ValueError(f"caches at position {positions(caches)} cannot be cut back to {k}")
    out = [_copy_state(c) if kind(c) == "linear" else copy_prefix(c, k) for c in caches]
    evaluate(out)
    if (mirror := _mirror(caches)) is not None:
        return mirror.clone(caches, k, out)
    return out


def keep_for_restore(caches: Caches) -> None:
    """Remember the caches' layer objects, which a failed remote prefill goes back to
    (`restore`); a decode group's other ranks remember theirs."""
    if (mirror := _mirror(caches)) is not None:
        mirror.order("save", {"id": caches.id})


def restore(caches: Caches, before: Caches) -> None:
    """The caches' layer objects as `before` held them (a fill replaces some)."""
    caches[:] = before
    if (mirror := _mirror(caches)) is not None:
        mirror.order("restore", {"id": caches.id})


def replace(caches: Caches, fresh: Caches) -> None:
    """The caches' layers as `fresh` holds them (`new_caches`), in place."""
    if (mirror := _mirror(caches)) is not None:
        mirror.replace(caches, fresh)
    else:
        caches[:] = fresh


def _mirror(caches: Caches) -> Any:
    """A decode group's caches' `Mirror` (group/mirror.py), which has the other ranks repeat
    an edit on their layers; None for a node of one process."""
    return getattr(caches, "mirror", None)


def trim_to(caches: Caches, k: int) -> None:
    """Drop whatever lies beyond position k (a failed remote prefill's partial layers)."""
    for c in caches:
        if size(c) > k:
            if not c.is_trimmable():
                raise ValueError(f"a {type(c).__name__} cannot be trimmed")
            c.trim(size(c) - k)
    if (mirror := _mirror(caches)) is not None:
        mirror.trimmed(caches, k)


def evaluate(caches: Caches) -> None:
    """Materialise the caches' arrays (mlx is lazy)."""
    mx.eval([c.state for c in caches])


# ---------------------------------------------------------------- generation


def prefill_chunks(
    model: Any, prompt: Sequence[int], caches: Caches, kv_format: KVFormat | None = None
) -> Iterator[list[int]]:
    """`generate_step`'s prompt loop a chunk at a time: all but the last token into `caches`,
    in PREFILL_STEP-token steps, yielding what is left after each (the last token at the end;
    nothing for a prompt of one token)."""
    rest = list(prompt)
    while len(rest) > 1:
        n = min(PREFILL_STEP, len(rest) - 1)
        with mx.stream(STREAM):
            model(mx.array(rest[:n])[None], cache=caches)
            quantize_when_due(caches, kv_format)
            evaluate(caches)
        rest = rest[n:]
        mx.clear_cache()
        yield rest


def prefill(
    model: Any, prompt: mx.array, caches: Caches, kv_format: KVFormat | None = None
) -> mx.array:
    """`generate_step`'s prompt loop whole; returns what is left (the last token)."""
    rest = prompt.tolist()
    for left in prefill_chunks(model, rest, caches, kv_format):
        rest = left
    return mx.array(rest)


def new_batch(model: Any) -> Any:
    """mlx-lm's continuous batching (`BatchGenerator`) on its own stream: sequences enter with
    their caches, their sampler and processors, each `next_generated()` steps them all."""
    return BatchGenerator(model, stream=STREAM, prefill_step_size=PREFILL_STEP)


def can_batch(caches: Caches) -> bool:
    """Whether mlx-lm can merge these caches into a batch: every layer's cache class has
    `merge` (KVCache, RotatingKVCache, ArraysCache in mlx-lm 0.32; a QuantizedKVCache has
    none). A decode group's rank 0 holds its own layers' caches: the others' are of the same
    kinds and quantized alike, and batch alike (`group/batch.py`)."""
    return all(hasattr(type(c), "merge") for c in caches)


def prefill_seconds(model: Any, count: int) -> float:
    """Seconds mlx takes to prefill `count` tokens into a scratch cache (after a warm-up:
    the first call allocates)."""
    vocab = vocab_size(model) if hasattr(model, "args") else 256
    tokens = mx.array([[(7 * i + 3) % vocab for i in range(count)]])
    model(tokens[:, :8], cache=new_caches(model))
    mx.eval(model.parameters())
    caches = new_caches(model)
    t0 = time.perf_counter()
    mx.eval(model(tokens, cache=caches))
    evaluate(caches)
    return max(time.perf_counter() - t0, 1e-9)
