"""gpt-oss (`gpt_oss`): sliding layers (a window of 128) alternating with full ones, as
mlx-lm's `make_cache()` holds them: a `RotatingKVCache(max_size=window)` or a `KVCache`.

Filled as Gemma 3's are (a sliding layer's frame holds the window it keeps), with one
difference: mlx-lm attends with sinks over a float cache only, so a quantized frame is a
`ProtocolError` (the decode node never asks for one: `kv_bits` is refused for this model).
"""

from __future__ import annotations

from typing import Any

from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode.families.base import LayerArrays
from tandem.nodes.decode.families.gemma3 import Gemma3Family
from tandem.nodes.model.spec import LayerKind


class GptOssFamily(Gemma3Family):
    name = "gpt_oss"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        if kv_format is not None:
            raise ProtocolError(
                f"layer {arrays.layer}: gpt-oss attends with sinks over a float cache only, "
                f"not {kv_format.bits}-bit K/V"
            )
        return super().fill(kind, cache, arrays, kv_format)
