"""DeepSeek V3 (`deepseek_v3`, Kimi K2): every layer's cache a `KVCache` holding, per position,
the latent (keys [1, 1, T, kv_lora]) and the rope key (values [1, 1, T, rope]), as mlx-lm's
`DeepseekV3Attention` keeps them; a "latent" layer's frame appends both, always in float
(mlx-lm attends over a quantized latent cache nowhere). The last prompt token runs whole: the
layer builds its own mask and absorbs the latent's up-projection for one query.
"""

from __future__ import annotations

from typing import Any

from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import LayerArrays
from tandem.nodes.decode.families.llama import GenericFamily
from tandem.nodes.model.spec import LayerKind


class DeepseekV3Family(GenericFamily):
    name = "deepseek_v3"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        if kind.kind != "latent":
            return super().fill(kind, cache, arrays, kv_format)
        if kv_format is not None or lm.kind(cache) != "full" or lm.quantized_form(cache):
            raise ProtocolError(f"layer {arrays.layer}: a latent layer's cache is float only")
        lm.append(cache, arrays.tensors["k"], arrays.tensors["v"])
        return cache
