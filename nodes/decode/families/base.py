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

Before a family sees a frame, the `CacheBuilder` checks the remote prefill's header and each
layer frame against the model (`KVShape`) and the request. A peer's bad frame (its shape, its
dtype, values that are not all finite, a KV form other than the one asked for) is a
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
from tandem.nodes.model.spec import FULL, LayerKind


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


@dataclass(frozen=True)
class KVShape:
    """What a model's layer frames must hold: [1, n_kv_heads, count, head_dim] in `dtype`, and
    a linear layer's `state` tensors (`Header.state`: name, dtype, shape)."""

    layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # the model's compute dtype, safetensors spelling
    state: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

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


def layer_arrays(frame: LayerFrame, header: Header) -> LayerArrays:
    """A frame's tensors as mlx arrays (copies of the frame's buffer; bf16 stays bf16)."""
    out = {}
    quantized = header.quantized(frame.layer)
    for name, array in layer_parts_to_numpy(frame, header).items():
        words = quantized and name in ("k", "v")  # packed uint32 words
        if header.dtype == "BF16" and not words:  # numpy holds the raw bits as uint16
            out[name] = mx.array(array).view(mx.bfloat16)
        else:
            out[name] = mx.array(array)
    return LayerArrays(frame.layer, out, header.start + header.count)


class CacheBuilder:
    """Puts each layer's new positions into that layer's cache (the prefix already there),
    once the header and each frame agree with the model and the request."""

    def __init__(
        self,
        header: Header,
        caches: lm.Caches,
        expect: KVShape,
        start: int,
        count: int,
        kv_format: KVFormat | None = None,
        family: DecodeFamily | None = None,
        kinds: Sequence[LayerKind] | None = None,
    ) -> None:
        got = (header.layers, header.n_kv_heads, header.head_dim, header.dtype)
        want = (expect.layers, expect.n_kv_heads, expect.head_dim, expect.dtype)
        if got != want or getattr(caches, "total", len(caches)) != expect.layers:
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
        kinds = tuple(kinds) if kinds is not None else (FULL,) * len(caches)
        want_kinds = (tuple(k.kind for k in kinds), tuple(k.window or 0 for k in kinds))
        if header.kinds and (header.kinds, header.windows) != want_kinds:
            raise ProtocolError(
                f"frames hold layers of kinds {header.kinds}, windows {header.windows}; "
                f"the model's are {want_kinds[0]}, {want_kinds[1]}"
            )
        if header.state != expect.state:
            raise ProtocolError(
                f"frames hold linear layers' state {header.state}, the model's {expect.state}"
            )
        if lm.positions(caches) != start:
            raise ProtocolError(f"frames start at {start}, the cache holds {lm.positions(caches)}")
        self.header, self.caches, self.kv_format = header, caches, kv_format
        self.family = family or DecodeFamily()
        self.kinds = kinds

    def add(self, frame: LayerFrame) -> None:
        """On the mlx thread: check the layer's values and put them into its cache."""
        arrays = layer_arrays(frame, self.header)
        t = arrays.tensors
        # words may hold any bits
        floats = _SCALES if self.header.quantized(frame.layer) else tuple(t)
        for name in floats:
            if not mx.isfinite(t[name]).all().item():
                raise ProtocolError(f"layer {frame.layer}: {name} are not all finite")
        i = frame.layer
        first = getattr(self.caches, "first", 0)  # a decode group: rank 0 holds the last
        if i < first:  # another rank's layer: its arrays to it
            self.caches.mirror.fill(self.caches, arrays, self.kv_format)  # type: ignore[attr-defined]
            return
        j = i - first
        self.caches[j] = self.family.fill(self.kinds[i], self.caches[j], arrays, self.kv_format)
        mx.eval(self.caches[j].state[:2])  # (K, V), or a state cache's (slots, padding)


_SCALES = ("k_scales", "k_biases", "v_scales", "v_biases")
