"""Gemma 3 (`gemma3_text`): five sliding-window layers for every global one (mlx-lm's
`make_cache()`: a `RotatingKVCache(max_size=window)` on sliding layers, a `KVCache` on global
ones).

A sliding layer's frame holds only the positions its window keeps, in float: they replace
the cache (`lm.fill_window`), after what the window still reaches of a cached prefix. The
cache then holds what mlx-lm's would after its own prefill, and trims and rotates as decoding
goes on. Global layers are the dense family's, quantized when the request asks (mlx-lm cannot
quantize a `RotatingKVCache`; a window is bounded anyway). The last prompt token runs whole
(no layer-at-a-time stepper: Gemma's layers need their own masks and embedding scale).
"""

from __future__ import annotations

from typing import Any

from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import LayerArrays, LayerStepper
from tandem.nodes.decode.families.llama import DenseFamily
from tandem.nodes.model.spec import LayerKind


class Gemma3Family(DenseFamily):
    name = "gemma3"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        if kind.kind != "sliding":
            return super().fill(kind, cache, arrays, kv_format)
        if lm.kind(cache) != "sliding" or cache.max_size != kind.window:
            raise ProtocolError(
                f"layer {arrays.layer}: a sliding layer of window {kind.window} needs its "
                f"rotating cache, not a {type(cache).__name__}"
            )
        try:
            return lm.fill_window(cache, arrays.tensors["k"], arrays.tensors["v"], arrays.end)
        except ValueError as e:
            raise ProtocolError(f"layer {arrays.layer}: {e}") from None

    def stepper(self, model: Any, token: int, caches: lm.Caches) -> LayerStepper | None:
        return None
