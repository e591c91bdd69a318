"""What a decode family does with a handoff, and the parts every family shares.

A family is one architecture's decode side (mlx-lm keeps one file per architecture; so do
we). It does two jobs:

- `fill`: put one layer frame's arrays into that layer's cache, by the layer's kind
  (`LayerKind` from the model spec, matching the cache `lm.new_caches` made for it):
  - "full": the frame holds K/V of new positions, appended (float, or quantized words,
    scales and biases for a quantized stream);
  - "sliding": the frame holds the last positions' K/V its window keeps, always float (a
    `RotatingKVCache`, refilled through `lm.fill_window`);
  - "linear": the frame holds a fixed-size state (an `ArraysCache`: its slots are set).
- `stepper`: the last prompt token's pass, run a layer at a time as layers land
  (`LayerStepper`), or None where the family does not know its model's structure: the decode
  node then runs that token's step whole.

`DecodeFamily` fills "full" layers; the kinds no family here has yet say so (a
`ProtocolError`: the request falls back to a local prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.model.spec import LayerKind


@dataclass(frozen=True)
class LayerArrays:
    """One layer frame's tensors as mlx arrays, by `Header.tensors` name: "k", "v" for float
    K/V [1, n_kv, count, D]; with "k_scales", "k_biases", "v_scales", "v_biases" when
    quantized ("k", "v" then hold uint32 words)."""

    layer: int
    tensors: dict[str, mx.array]
    end: int  # positions 0..end-1 are in the layer's cache once these are


class LayerStepper(Protocol):
    """The last prompt token's pass, a layer at a time (on the mlx thread)."""

    token: int  # the token whose pass it runs

    def advance(self, layer: int) -> None:
        """Run layer `layer` (its cache now holds the prompt)."""

    @property
    def complete(self) -> bool:
        """Every layer ran."""

    def logits(self) -> mx.array:
        """[1, vocab]: the last prompt token's logits (every layer advanced)."""


class DecodeFamily:
    """A family's decode side; this base fills "full" layers and knows no structure."""

    name = "generic"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        """The layer's cache with the frame's arrays in (a new object where its form
        changes: a float layer taking quantized frames)."""
        if kind.kind != "full" or lm.kind(cache) != "full":
            raise ProtocolError(
                f"layer {arrays.layer}: a {kind.kind} layer ({type(cache).__name__}) is not "
                f"filled by the {self.name} decode family"
            )
        if kv_format is None:
            t = arrays.tensors
            lm.append(cache, t["k"], t["v"])
            return cache
        return fill_quantized(cache, arrays, kv_format)

    def stepper(self, model: Any, token: int, caches: lm.Caches) -> LayerStepper | None:
        return None


def fill_quantized(cache: Any, arrays: LayerArrays, kv_format: KVFormat) -> Any:
    """A full-attention layer's quantized positions appended; its float prefix (if any)
    quantized first, as mlx-lm would have."""
    cache = lm.to_quantized(cache, kv_format)
    if lm.quantized_form(cache) != (kv_format.bits, kv_format.group_size):
        raise ProtocolError(f"layer {arrays.layer}: the cache is quantized otherwise")
    t = arrays.tensors
    lm.append_quantized(
        cache, (t["k"], t["k_scales"], t["k_biases"]), (t["v"], t["v_scales"], t["v_biases"])
    )
    return cache
