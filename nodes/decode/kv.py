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
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from tandem.nodes.contract.frames import (
    Header,
    LayerFrame,
    ProtocolError,
    layer_parts_to_numpy,
    layer_to_numpy,
)
from tandem.nodes.contract.http import KVFormat, KVKernel

Caches = list[Any]  # one mlx-lm cache per layer

_MX_DTYPE = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def new_caches(model: Any) -> Caches:
    return make_prompt_cache(model)


def _size(cache: Any) -> int:
    # `size()` where the cache has one (QuantizedKVCache's says 0 in mlx-lm 0.32): `offset`
    return cache.offset if isinstance(cache, QuantizedKVCache) else cache.size()


def positions(caches: Caches) -> int:
    """Token positions the caches hold (every layer holds the same)."""
    return _size(caches[0]) if caches else 0


def trim_to(caches: Caches, k: int) -> None:
    """Drop whatever lies beyond position k (a failed remote prefill's partial layers)."""
    for c in caches:
        if _size(c) > k:
            if not c.is_trimmable():
                raise ValueError(f"a {type(c).__name__} cannot be trimmed")
            c.trim(_size(c) - k)


def nbytes(caches: Caches) -> int:
    return sum(c.nbytes for c in caches)


def clone_prefix(caches: Caches, k: int) -> Caches:
    """New caches holding positions 0..k-1 of `caches` (fresh arrays: the source stays as is),
    of the same kind (float or quantized)."""
    out: Caches = []
    for c in caches:
        if isinstance(c, QuantizedKVCache):
            new = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
            if k:
                keys, values = c.state[:2]
                _append_quantized(new, tuple(x[..., :k, :] for x in keys),
                                  tuple(x[..., :k, :] for x in values))  # fmt: skip
        else:
            new = KVCache()
            if k:
                keys, values = c.state[:2]  # mlx-lm 0.32 adds the offset as a third field
                new.update_and_fetch(keys[..., :k, :], values[..., :k, :])
        out.append(new)
    evaluate(out)
    return out


def format_of(caches: Caches) -> KVFormat | None:
    """The KV format the caches hold (None: full precision)."""
    c = caches[0] if caches else None
    if isinstance(c, QuantizedKVCache):
        return KVFormat(c.bits, c.group_size, device_kernel())
    return None


def device_kernel() -> KVKernel:
    """Whose `mx.quantize` rounding this node's caches get: mlx's CPU kernel or its GPU one."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def quantize_when_due(caches: Caches, kv_format: KVFormat | None) -> None:
    """mlx-lm's own step: float caches become quantized (`quantized_kv_start=0`)."""
    if kv_format is not None:
        maybe_quantize_kv_cache(caches, 0, kv_format.group_size, kv_format.bits)


def from_quantized(layers: list[dict[str, mx.array]], kv_format: KVFormat) -> Caches:
    """QuantizedKVCaches holding each layer's packed K and V (`Header.tensors` names)."""
    caches: Caches = []
    for parts in layers:
        cache = QuantizedKVCache(group_size=kv_format.group_size, bits=kv_format.bits)
        _append_quantized(
            cache,
            (parts["k"], parts["k_scales"], parts["k_biases"]),
            (parts["v"], parts["v_scales"], parts["v_biases"]),
        )
        caches.append(cache)
    evaluate(caches)
    return caches


def _append_quantized(
    cache: QuantizedKVCache, keys: tuple[mx.array, ...], values: tuple[mx.array, ...]
) -> None:
    """Append already-quantized positions (words, scales, biases) to a quantized cache, as
    its `update_and_fetch` would after quantizing them itself."""
    prev = cache.offset
    if cache.keys is None:
        cache.keys, cache.values = keys, values
    else:
        cache.keys = tuple(
            mx.concatenate([old[..., :prev, :], new], axis=2)
            for old, new in zip(cache.keys, keys, strict=True)
        )
        cache.values = tuple(
            mx.concatenate([old[..., :prev, :], new], axis=2)
            for old, new in zip(cache.values, values, strict=True)
        )
    cache.offset = prev + keys[0].shape[2]


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

    def bytes_per_token(self, kv_format: KVFormat | None) -> int:
        """K and V bytes of one token over all layers, in the wire's format."""
        itemsize = 4 if self.dtype == "F32" else 2
        if kv_format is None:
            return 2 * self.layers * self.n_kv_heads * self.head_dim * itemsize
        return kv_format.bytes_per_token(self.layers, self.n_kv_heads, self.head_dim, itemsize)


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
        self,
        header: Header,
        caches: Caches,
        expect: KVShape,
        start: int,
        count: int,
        kv_format: KVFormat | None = None,
    ) -> None:
        got = (header.layers, header.n_kv_heads, header.head_dim, header.dtype)
        want = (expect.layers, expect.n_kv_heads, expect.head_dim, expect.dtype)
        if got != want or len(caches) != expect.layers:
            raise ProtocolError(
                f"frames hold (layers, kv heads, head dim, dtype) {got}, the model {want}"
            )
        asked = (kv_format.bits, kv_format.group_size) if kv_format else (0, 0)
        if (header.kv_bits, header.kv_group_size if header.kv_bits else 0) != asked:
            raise ProtocolError(
                f"frames hold KV as (bits, group) {(header.kv_bits, header.kv_group_size)}, "
                f"asked for {asked}"
            )
        self.kv_format = kv_format
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
        if self.kv_format is not None:
            self._add_quantized(frame, self.kv_format)
            return
        k, v = layer_arrays(frame, self.header)
        if not (mx.isfinite(k).all() and mx.isfinite(v).all()).item():
            raise ProtocolError(f"layer {frame.layer} holds values that are not finite")
        cache = self.caches[frame.layer]
        cache.update_and_fetch(k, v)
        mx.eval(cache.state)

    def _add_quantized(self, frame: LayerFrame, kv_format: KVFormat) -> None:
        parts = _mx_parts(frame, self.header)
        for name in ("k_scales", "k_biases", "v_scales", "v_biases"):
            if not mx.isfinite(parts[name]).all().item():
                raise ProtocolError(f"layer {frame.layer}: {name} are not all finite")
        i = frame.layer
        cache = self.caches[i]
        if not isinstance(cache, QuantizedKVCache):  # its prefix (if any) quantized as mlx-lm does
            cache = self.caches[i] = cache.to_quantized(kv_format.group_size, kv_format.bits)
        if (cache.bits, cache.group_size) != (kv_format.bits, kv_format.group_size):
            raise ProtocolError(f"layer {i}: the cache is quantized otherwise")
        _append_quantized(
            cache,
            (parts["k"], parts["k_scales"], parts["k_biases"]),
            (parts["v"], parts["v_scales"], parts["v_biases"]),
        )
        mx.eval(cache.state[:2])


def _mx_parts(frame: LayerFrame, header: Header) -> dict[str, mx.array]:
    """A quantized layer frame's tensors as mlx arrays (copies of the frame's buffer)."""
    out = {}
    for name, array in layer_parts_to_numpy(frame, header).items():
        if name in ("k", "v"):
            out[name] = mx.array(array)  # uint32 words
        elif header.dtype == "BF16":
            out[name] = mx.array(array).view(mx.bfloat16)
        else:
            out[name] = mx.array(array)
    return out
