"""What a decode family is, and the records every family and the remote prefill share.

A family is one architecture's decode side (mlx-lm keeps one file per architecture; so do
we). It does two jobs:

- `fill`: put one layer frame's arrays into that layer's cache, by the layer's kind
  (`LayerKind` from the model spec, matching the cache `lm.new_caches` made for it):
  - "full": the frame holds K/V of new positions, appended (float, or quantized words,
    scales and biases for a quantized stream): the dense family (`llama.py`), which the
    other families extend;
  - "sliding": the frame holds the last positions' K/V its window keeps, always float (a
    `RotatingKVCache`, refilled through `lm.fill_window`): `gemma3.py`;
  - "linear": the frame holds a fixed-size state (an `ArraysCache`: its slots are set):
    `qwen3_5.py`.
  A kind the family does not fill is a `ProtocolError` (the request falls back to a local
  prefill).
- `stepper`: the last prompt token's pass, run a layer at a time as layers land
  (`LayerStepper`), or None where the family does not know its model's structure: the decode
  node then runs that token's step whole.

Before a family sees a frame, the remote prefill checks the frames' header against the model
(`KVShape.check`) and reads each layer frame's arrays (`layer_arrays`). A peer's bad frame (its
shape, its dtype, values that are not all finite, a KV form other than the one asked for) is a
`ProtocolError`, and the request falls back to a local prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from tandem.nodes.contract.frames import Header, LayerFrame, ProtocolError, layer_parts_to_numpy
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
    """A family's decode side; this base fills no layer and knows no structure."""

    name = "base"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        """The layer's cache with the frame's arrays in (a new object where its form
        changes: a float layer taking quantized frames)."""
        raise ProtocolError(
            f"layer {arrays.layer}: a {kind.kind} layer ({type(cache).__name__}) is not "
            f"filled by the {self.name} decode family"
        )

    def stepper(self, model: Any, token: int, caches: lm.Caches) -> LayerStepper | None:
        return None


@dataclass(frozen=True)
class KVShape:
    """What a model's layer frames must hold: [1, n_kv_heads, count, head_dim] in `dtype`, and
    a linear layer's `state` tensors (`Header.state`: name, dtype, shape)."""

    layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # the model's compute dtype, safetensors spelling
    state: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    latent: tuple[int, ...] = ()  # a latent layer's (latent width, rope key width): `Header.latent`

    def held_as(self, kv_format: KVFormat | None) -> str:
        """How a request's KV is held: the model's dtype, or `q8/g64`-style."""
        if kv_format is None:
            return self.dtype.lower()
        return f"q{kv_format.bits}/g{kv_format.group_size}"

    def bytes_per_token(self, kv_format: KVFormat | None) -> int:
        """K and V bytes of one token over all layers, in the wire's format."""
        itemsize = 4 if self.dtype == "F32" else 2
        if kv_format is None:
            return 2 * self.layers * self.n_kv_heads * self.head_dim * itemsize
        return kv_format.bytes_per_token(self.layers, self.n_kv_heads, self.head_dim, itemsize)

    def check(
        self,
        header: Header,
        caches: lm.Caches,
        start: int,
        count: int,
        kv_format: KVFormat | None,
        kinds: Sequence[LayerKind],
    ) -> None:
        """ProtocolError unless a remote prefill's frames, as `header` says, are what the
        model (`self`, `kinds`) and the request (`start`, `count`, `kv_format`) want and
        `caches` hold the `start` positions before them."""
        got = (header.layers, header.n_kv_heads, header.head_dim, header.dtype)
        want = (self.layers, self.n_kv_heads, self.head_dim, self.dtype)
        if got != want or getattr(caches, "total", len(caches)) != self.layers:
            raise ProtocolError(
                f"frames hold (layers, kv heads, head dim, dtype) {got}, the model {want}"
            )
        asked = (kv_format.bits, kv_format.group_size) if kv_format else (0, 0)
        if (header.kv_bits, header.kv_group_size if header.kv_bits else 0) != asked:
            raise ProtocolError(
                f"frames hold KV as (bits, group) {(header.kv_bits, header.kv_group_size)}, "
                f"asked for {asked}"
            )
        if (header.start, header.count) != (start, count):
            raise ProtocolError(
                f"frames cover {header.count} positions from {header.start}, "
                f"asked for {count} from {start}"
            )
        want_kinds = (tuple(k.kind for k in kinds), tuple(k.window or 0 for k in kinds))
        if header.kinds and (header.kinds, header.windows) != want_kinds:
            raise ProtocolError(
                f"frames hold layers of kinds {header.kinds}, windows {header.windows}; "
                f"the model's are {want_kinds[0]}, {want_kinds[1]}"
            )
        if header.state != self.state:
            raise ProtocolError(
                f"frames hold linear layers' state {header.state}, the model's {self.state}"
            )
        if header.latent != self.latent:
            raise ProtocolError(f"frames hold latents {header.latent}, the model's {self.latent}")
        if lm.positions(caches) != start:
            raise ProtocolError(f"frames start at {start}, the cache holds {lm.positions(caches)}")


def layer_arrays(frame: LayerFrame, header: Header) -> LayerArrays:
    """A frame's tensors as mlx arrays (copies of the frame's buffer; bf16 stays bf16);
    ProtocolError where its float values are not all finite (packed words may hold any bits)."""
    out = {}
    quantized = header.quantized(frame.layer)
    for name, array in layer_parts_to_numpy(frame, header).items():
        words = quantized and name in ("k", "v")  # packed uint32 words
        if header.dtype == "BF16" and not words:  # numpy holds the raw bits as uint16
            out[name] = mx.array(array).view(mx.bfloat16)
        else:
            out[name] = mx.array(array)
        if not words and not mx.isfinite(out[name]).all().item():
            raise ProtocolError(f"layer {frame.layer}: {name} are not all finite")
    return LayerArrays(frame.layer, out, header.start + header.count)
