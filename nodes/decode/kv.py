"""KV frames → mlx-lm `KVCache`s: one cache per layer, filled as layer frames arrive."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from nodes.wire import Header, LayerKV, ProtocolError, layer_to_numpy


def layer_arrays(frame: LayerKV, header: Header) -> tuple[mx.array, mx.array]:
    """K, V [1, n_kv, count, D] from the frame's received pieces (bf16 stays bf16)."""
    k, v = layer_to_numpy(frame, header)
    if header.dtype == "BF16":  # numpy holds the raw bits as uint16
        return mx.array(k).view(mx.bfloat16), mx.array(v).view(mx.bfloat16)
    return mx.array(k), mx.array(v)


class CacheBuilder:
    """Appends each layer's new positions to that layer's cache (the prefix already there)."""

    def __init__(self, header: Header, caches: list[Any]) -> None:
        if header.layers != len(caches):
            raise ProtocolError(f"header says {header.layers} layers, the model has {len(caches)}")
        for c in caches:
            if c.offset != header.start:
                raise ProtocolError(f"frames start at {header.start}, the cache holds {c.offset}")
        self.header = header
        self.caches = caches

    def add(self, frame: LayerKV) -> None:
        k, v = layer_arrays(frame, self.header)
        cache: KVCache = self.caches[frame.layer]
        cache.update_and_fetch(k, v)
        mx.eval(cache.keys, cache.values)
