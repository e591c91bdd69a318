"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`): three Gated DeltaNet layers for every full-attention one
(mlx-lm's `make_cache()`: an `ArraysCache(size=2)` on linear layers, a `KVCache` on the
others).

A linear layer's frame holds its state after the prompt, "conv" [1, K-1, conv_dim] and
"recurrent" [1, Hv, Dv, Dk] (float32): they go into a new cache's slots, in mlx-lm's order
(the old cache is left as it was, for a failed prefill to fall back to). Whatever a cached
prefix left there is replaced: the state covers the whole prompt. Full layers are the dense
family's, quantized when the request asks (the state never is). The last prompt token runs
whole (no layer-at-a-time stepper: the model holds its layers under `language_model`, with
a mask per layer kind).
"""

from __future__ import annotations

from typing import Any

from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import LayerArrays, LayerStepper
from tandem.nodes.decode.families.llama import DenseFamily
from tandem.nodes.model.spec import LayerKind

STATE_SLOTS = ("conv", "recurrent")  # an ArraysCache's slots, in order


class Qwen35Family(DenseFamily):
    name = "qwen3_5"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        if kind.kind != "linear":
            return super().fill(kind, cache, arrays, kv_format)
        if lm.kind(cache) != "linear" or len(cache.cache) != len(STATE_SLOTS):
            raise ProtocolError(
                f"layer {arrays.layer}: a linear layer needs its two-slot state cache, not a "
                f"{type(cache).__name__}"
            )
        new = lm.new_state_cache(len(STATE_SLOTS))
        lm.fill_state(new, [arrays.tensors[name] for name in STATE_SLOTS])
        return new

    def stepper(self, model: Any, token: int, caches: lm.Caches) -> LayerStepper | None:
        return None
