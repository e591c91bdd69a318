"""mlx-lm KV caches: the only module that touches mlx-lm's cache classes.

Everything else holds a model's caches as an opaque `Caches` (one per layer) and asks this
module to make, fill, measure, copy or trim them. Written against the caches' public API
(`size`, `trim`, `is_trimmable`, `nbytes`, `update_and_fetch`, `state`), so another cache kind
(a quantized KV cache, a linear-attention state) slots in here and nowhere else.

A layer frame is checked against what the model expects before it touches a cache: its
shape, its dtype and its values (all finite) — a peer's bad frame is a `ProtocolError`, and
the request falls back to a local prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from nodes.wire import Header, LayerFrame, ProtocolError, layer_to_numpy

Caches = list[Any]  # one mlx-lm cache per layer

_MX_DTYPE = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def new_caches(model: Any) -> Caches:
    return make_prompt_cache(model)


def positions(caches: Caches) -> int:
    """Token positions the caches hold (every layer holds the same)."""
    return caches[0].size() if caches else 0


def trim_to(caches: Caches, k: int) -> None:
    """Drop whatever lies beyond position k (a failed remote prefill's partial layers)."""
    for c in caches:
        if c.size() > k:
            if not c.is_trimmable():
                raise ValueError(f"a {type(c).__name__} cannot be trimmed")
            c.trim(c.size() - k)


def nbytes(caches: Caches) -> int:
    return sum(c.nbytes for c in caches)


def clone_prefix(caches: Caches, k: int) -> Caches:
    """New caches holding positions 0..k-1 of `caches` (fresh arrays: the source stays as is)."""
    out = []
    for c in caches:
        new = KVCache()
        if k:
            keys, values = c.state[:2]  # mlx-lm 0.32 adds the offset as a third field
            new.update_and_fetch(keys[..., :k, :], values[..., :k, :])
        out.append(new)
    evaluate(out)
    return out


def evaluate(caches: Caches) -> None:
    """Materialise the caches' arrays (mlx is lazy)."""
    mx.eval([c.state for c in caches])


@dataclass(frozen=True)
class KVShape:
    """What a model's layer frames must hold: [1, n_kv_heads, count, head_dim] in `dtype`."""

    layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # the model's compute dtype, safetensors spelling


def layer_arrays(frame: LayerFrame, header: Header) -> tuple[mx.array, mx.array]:
    """K, V [1, n_kv, count, D] from the frame's received pieces (bf16 stays bf16)."""
    k, v = layer_to_numpy(frame, header)
    if header.dtype == "BF16":  # numpy holds the raw bits as uint16
        return mx.array(k).view(mx.bfloat16), mx.array(v).view(mx.bfloat16)
    return mx.array(k), mx.array(v)


class CacheBuilder:
    """Appends each layer's new positions to that layer's cache (the prefix already there),
    once the header and each frame agree with the model and the request."""

    def __init__(
        self, header: Header, caches: Caches, expect: KVShape, start: int, count: int
    ) -> None:
        got = (header.layers, header.n_kv_heads, header.head_dim, header.dtype)
        want = (expect.layers, expect.n_kv_heads, expect.head_dim, expect.dtype)
        if got != want or len(caches) != expect.layers:
            raise ProtocolError(
                f"frames hold (layers, kv heads, head dim, dtype) {got}, the model {want}"
            )
        if (header.start, header.count) != (start, count):
            raise ProtocolError(
                f"frames cover {header.count} positions from {header.start}, "
                f"asked for {count} from {start}"
            )
        if positions(caches) != start:
            raise ProtocolError(f"frames start at {start}, the cache holds {positions(caches)}")
        self.header = header
        self.caches = caches

    def add(self, frame: LayerFrame) -> None:
        """On the mlx thread: check the layer's values and append them to its cache."""
        k, v = layer_arrays(frame, self.header)
        if not (mx.isfinite(k).all() and mx.isfinite(v).all()).item():
            raise ProtocolError(f"layer {frame.layer} holds values that are not finite")
        cache = self.caches[frame.layer]
        cache.update_and_fetch(k, v)
        mx.eval(cache.state)
