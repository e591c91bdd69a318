"""Gemma 3 (`gemma3_text`): five sliding-window layers for every global one (mlx-lm's
`make_cache()`: a `RotatingKVCache(max_size=window)` on sliding layers, a `KVCache` on global
ones).

A sliding layer's frame holds K/V of the prompt's new positions (the prefill side hands over
all of them for now; only the window is the wire's next step). They go in through the cache's
own `update_and_fetch`, as one update, as mlx-lm's prefill puts them there: the cache then
holds what mlx-lm's would, and trims itself to its window as decoding goes on. Global layers
are the base family's. A sliding layer takes float K/V only (bounded, and mlx-lm cannot
quantize a `RotatingKVCache`): a quantized frame for one is a `ProtocolError`, and the request
falls back to a local prefill. The last prompt token runs whole (no layer-at-a-time stepper:
Gemma's layers need their own masks and embedding scale).
"""

from __future__ import annotations

from typing import Any

from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import DecodeFamily, LayerArrays
from tandem.nodes.model.spec import LayerKind


class Gemma3Family(DecodeFamily):
    name = "gemma3"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        if kind.kind != "sliding":
            return super().fill(kind, cache, arrays, kv_format)
        if lm.kind(cache) != "sliding" or kv_format is not None:
            raise ProtocolError(
                f"layer {arrays.layer}: a sliding layer takes float K/V into its rotating cache"
            )
        lm.append(cache, arrays.tensors["k"], arrays.tensors["v"])
        return cache
