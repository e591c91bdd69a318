"""KV frames: the streamed body of a `/v1/prefill` response (DESIGN.md "KV frames").

A frame is `u8 kind` + `u64` little-endian payload length + payload. Header, done and error
payloads are JSON; a layer payload is a safetensors blob, metadata `{"layer": "i"}`, holding
`k` and `v`, each `[1, n_kv_heads, count, head_dim]` in the header's dtype, or, when the
header's `kv_bits` is 8 or 4, mlx's affine quantized form (`Header.tensors`): `k` and `v` as
packed uint32 words `[1, n_kv_heads, count, head_dim·bits/32]` and `k_scales`, `k_biases`,
`v_scales`, `v_biases` `[1, n_kv_heads, count, head_dim/kv_group_size]` in the header's dtype.
A header's `kinds` and `windows` (one per layer; both empty: every layer "full") say what
each layer frame covers: a "full" layer the `count` new positions, a "sliding" layer with
window w only the last `min(count, w)` of them (what its rotating cache keeps), always in
float (the header's `kv_bits` applies to full layers only); a "linear" layer (linear
attention) holds no K/V but its fixed-size state after position start+count-1: the tensors
the header's `state` names (name, dtype, shape), the same for every linear layer (Qwen3.5:
"conv" [1, K-1, conv_dim] in the model dtype and "recurrent" [1, Hv, Dv, Dk] in F32); a
"latent" layer (multi-head latent attention, DeepSeek V3) holds per new position its latent
and its roped key as mlx-lm's cache keeps them: `k` [1, 1, count, latent[0]] and `v`
[1, 1, count, latent[1]] (the header's `latent`), always in float (mlx-lm attends a latent
cache in float only).

This module holds the format: the frame records, the header's checks, the encoders and
`FrameWriter`, which produces a valid stream; `frame_reader.FrameReader` checks one as it is
read. Stdlib and numpy only: both the torch and the mlx side import this.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from tandem.nodes.contract.http import KV_BITS, KV_GROUP_SIZES, PROTO
from tandem.nodes.model.safetensors_format import RawTensor, encode_parts, nbytes_of

try:  # ISA-L's crc32 is zlib's, at tens of GB/s instead of a few: the receive path's biggest cost
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the same function
    from zlib import crc32

KIND_HEADER, KIND_LAYER, KIND_DONE, KIND_ERROR = 1, 2, 3, 4
PREFIX = struct.Struct("<BQ")  # kind, payload length: 9 bytes
MAX_JSON_BYTES = 64 * 1024  # header, done and error payloads
LAYER_EXTRA_BYTES = 64 * 1024  # a layer payload's allowance beyond its K and V bytes
WIRE_DTYPES = ("F32", "F16", "BF16")
LAYER_KINDS = ("full", "sliding", "linear", "latent")
MAX_STATE_TENSORS, MAX_STATE_DIMS = 8, 8  # a linear layer's state: tensors, dims each
_HEADER_SIZES = {"layers": 1, "start": 0, "count": 0, "n_kv_heads": 1, "head_dim": 1}  # least
_NUMPY_DTYPE = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "U32": np.dtype("<u4"),
}  # fmt: skip


class ProtocolError(Exception):
    """A KV frame stream that breaks the format; the message says how."""


@dataclass(frozen=True)
class Header:
    """First frame: what the layer frames that follow hold."""

    proto: int
    fingerprint: str
    request_id: str
    dtype: str  # safetensors spelling: F32, F16, BF16
    layers: int
    start: int  # first token position covered
    count: int  # tokens covered: positions start..start+count-1
    n_kv_heads: int
    head_dim: int
    kv_bits: int = 0  # 8 or 4: K and V quantized as mx.quantize does (words, scales, biases)
    kv_group_size: int = 0  # values per scale and bias when quantized
    kinds: tuple[str, ...] = ()  # per layer: "full", "sliding" or "linear"; (): all "full"
    windows: tuple[int, ...] = ()  # per layer: a sliding layer's window, 0 for the others
    # a linear layer's state tensors: (name, dtype, shape) each, the same for every such layer
    state: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    latent: tuple[int, ...] = ()  # a latent layer's (latent width, rope key width); (): none

    def kind(self, layer: int) -> str:
        return self.kinds[layer] if self.kinds else "full"

    def positions(self, layer: int) -> int:
        """Positions layer `layer`'s frame covers: the last of start..start+count-1 (a linear
        layer's state covers none one by one: 0)."""
        if self.kind(layer) == "linear":
            return 0
        if self.kind(layer) == "sliding":
            return min(self.count, self.windows[layer])
        return self.count

    def quantized(self, layer: int) -> bool:
        return bool(self.kv_bits) and self.kind(layer) == "full"

    def shape(self, layer: int) -> tuple[int, int, int, int]:
        """Shape of each of layer `layer`'s K and V: [1, n_kv_heads, positions, head_dim]."""
        return (1, self.n_kv_heads, self.positions(layer), self.head_dim)

    def latent_shapes(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A latent layer's `k` (its latents) and `v` (its rope keys) shapes."""
        n = self.positions(layer)
        return (1, 1, n, self.latent[0]), (1, 1, n, self.latent[1])

    def tensors(self, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name → (dtype, shape) of each tensor in layer `layer`'s blob: K and V, or their
        packed uint32 words [.., head_dim * bits / 32] and scales and biases
        [.., head_dim / group] in the header's dtype; a linear layer's state tensors."""
        if self.kind(layer) == "linear":
            return {name: (dtype, shape) for name, dtype, shape in self.state}
        if self.kind(layer) == "latent":
            k, v = self.latent_shapes(layer)
            return {"k": (self.dtype, k), "v": (self.dtype, v)}
        shape = self.shape(layer)
        if not self.quantized(layer):
            return {"k": (self.dtype, shape), "v": (self.dtype, shape)}
        n, words = shape[:3], self.head_dim * self.kv_bits // 32
        groups = self.head_dim // self.kv_group_size
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for x in ("k", "v"):
            out[x] = ("U32", (*n, words))
            out[f"{x}_scales"] = (self.dtype, (*n, groups))
            out[f"{x}_biases"] = (self.dtype, (*n, groups))
        return out


@dataclass(frozen=True)
class LayerFrame:
    """One layer's tensors as raw row-major bytes by name (`Header.tensors`): views of
    `payload`, the safetensors blob, in the buffer the frame was read into. `k` and `v` are
    K and V (a full or sliding layer), the packed words when quantized (`Header.kv_bits`)."""

    layer: int
    payload: memoryview
    parts: dict[str, memoryview]

    @property
    def wire_bytes(self) -> int:
        """The frame's bytes on the wire: its prefix and its payload."""
        return PREFIX.size + len(self.payload)

    @property
    def k(self) -> memoryview:
        return self.parts["k"]

    @property
    def v(self) -> memoryview:
        return self.parts["v"]


@dataclass(frozen=True)
class Done:
    """Last frame: layer count and the chained zlib.crc32 of all layer payloads."""

    layers: int
    crc32: int


@dataclass(frozen=True)
class ErrorFrame:
    """The sender gave up; nothing follows it."""

    code: str
    message: str


Frame = Header | LayerFrame | Done | ErrorFrame


def max_layer_payload(header: Header, layer: int, extra: int = LAYER_EXTRA_BYTES) -> int:
    """Largest acceptable payload of layer `layer`'s frame in bytes: its tensors plus `extra`
    for the blob header."""
    return sum(nbytes_of(d, shape) for d, shape in header.tensors(layer).values()) + extra


def _frame(kind: int, payload: bytes) -> bytes:
    return PREFIX.pack(kind, len(payload)) + payload


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_header(h: Header) -> bytes:
    """The header frame for `h`."""
    return _frame(KIND_HEADER, _json(dataclasses.asdict(h)))


def encode_tensors(layer: int, given: dict[str, bytes | memoryview], header: Header) -> bytes:
    """The whole frame for one layer's tensors by name, exactly those `header.tensors(layer)`
    names (K/V, quantized K/V, or a linear layer's state), each row-major bytes."""
    tensors: dict[str, RawTensor] = {}
    total = 0
    for name, (dtype, shape) in header.tensors(layer).items():
        if name not in given:
            raise ProtocolError(f"layer {layer}: {name} is missing")
        data = memoryview(given[name]).cast("B")  # lengths in bytes
        want = nbytes_of(dtype, shape)
        if len(data) != want:
            raise ProtocolError(f"layer {layer}: {name} is {len(data)} bytes, header says {want}")
        tensors[name] = RawTensor(dtype, shape, data)
        total += want
    head, *data = encode_parts(tensors, {"layer": str(layer)})
    return b"".join([PREFIX.pack(KIND_LAYER, len(head) + total), head, *data])


def encode_done(layers: int, crc32: int) -> bytes:
    """The done frame; `crc32` chains zlib.crc32 over the layer payloads in order."""
    return _frame(KIND_DONE, _json({"layers": layers, "crc32": crc32}))


def encode_error(code: str, message: str) -> bytes:
    """An error frame: the stream ends here."""
    return _frame(KIND_ERROR, _json({"code": code, "message": message}))


class FrameWriter:
    """Builds one stream in order: `start()`, `layer(0..layers-1)`, then `done()` (or `error()`)."""

    def __init__(self, header: Header) -> None:
        check_header(header)
        self.header = header
        self.crc32 = 0  # chained over layer payloads so far
        self.next_layer = 0
        self._started = False
        self._closed = False

    def _expect(self, ok: bool, what: str) -> None:
        if self._closed or not ok:
            raise ProtocolError(f"FrameWriter: {what} out of order")

    def start(self) -> bytes:
        """The header frame."""
        self._expect(not self._started, "header")
        self._started = True
        return encode_header(self.header)

    def layer(
        self,
        layer: int,
        k: bytes | memoryview,
        v: bytes | memoryview,
        quantized: dict[str, bytes | memoryview] | None = None,
    ) -> bytes:
        """The frame for the next layer's K and V; layers must come 0, 1, 2, ..."""
        return self.tensors(layer, {"k": k, "v": v, **(quantized or {})})

    def tensors(self, layer: int, given: dict[str, bytes | memoryview]) -> bytes:
        """The frame for the next layer, its tensors by name (`Header.tensors`)."""
        self._expect(self._started and layer == self.next_layer < self.header.layers, "layer")
        frame = encode_tensors(layer, given, self.header)
        self.crc32 = crc32(memoryview(frame)[PREFIX.size :], self.crc32)
        self.next_layer += 1
        return frame

    def done(self) -> bytes:
        """The done frame, once every layer has been written."""
        self._expect(self._started and self.next_layer == self.header.layers, "done")
        self._closed = True
        return encode_done(self.header.layers, self.crc32)

    def error(self, code: str, message: str) -> bytes:
        """An error frame; nothing may be written after it."""
        self._expect(True, "error")
        self._closed = True
        return encode_error(code, message)


# Values from the wire are checked for type before they go into a message: the repr of
# deeply nested JSON could itself raise RecursionError.
def check_uint(value: object, what: str, least: int = 0) -> int:
    if type(value) is not int or value < least:
        raise ProtocolError(f"{what} must be an integer >= {least}")
    return value


def check_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a string")
    return value


def check_proto(proto: object) -> None:
    if type(proto) is not int or proto != PROTO:
        shown = (
            proto if type(proto) is int else "missing" if proto is None else type(proto).__name__
        )
        raise ProtocolError(f"protocol version {shown}, this node speaks {PROTO}")


def check_header(h: Header) -> None:
    check_proto(h.proto)
    check_str(h.fingerprint, "header fingerprint")
    check_str(h.request_id, "header request_id")
    if check_str(h.dtype, "header dtype") not in WIRE_DTYPES:
        raise ProtocolError(f"header dtype {h.dtype!r} is not one of {WIRE_DTYPES}")
    for name, least in _HEADER_SIZES.items():
        check_uint(getattr(h, name), f"header {name}", least)
    if check_uint(h.kv_bits, "header kv_bits") not in (0, *KV_BITS):
        raise ProtocolError(f"header kv_bits {h.kv_bits} is not one of {(0, *KV_BITS)}")
    group = check_uint(h.kv_group_size, "header kv_group_size")
    if not h.kv_bits and group:
        raise ProtocolError(f"header kv_group_size {group} for full-precision KV (kv_bits 0)")
    _check_state(h)
    _check_kinds(h)
    if h.kv_bits:
        if group not in KV_GROUP_SIZES or h.head_dim % group:
            raise ProtocolError(
                f"header kv_group_size {group}: not one of {KV_GROUP_SIZES} dividing "
                f"head_dim {h.head_dim}"
            )
        if h.head_dim * h.kv_bits % 32:
            raise ProtocolError(f"head_dim {h.head_dim} does not pack into 32-bit words")


def _check_kinds(h: Header) -> None:
    """Both per-layer lists empty, or one entry a layer: "full" with window 0, or "sliding"
    with a window of one position or more."""
    if not isinstance(h.kinds, tuple) or not isinstance(h.windows, tuple):
        raise ProtocolError("header kinds and windows must be lists")
    if not h.kinds and not h.windows:
        return
    if len(h.kinds) != h.layers or len(h.windows) != h.layers:
        raise ProtocolError(
            f"header kinds and windows must have one entry for each of {h.layers} layers"
        )
    for i, (kind, window) in enumerate(zip(h.kinds, h.windows, strict=True)):
        check_uint(window, f"header window of layer {i}")
        if kind not in LAYER_KINDS or (kind == "sliding") != (window > 0):
            raise ProtocolError(f"header layer {i}: kind {kind!r} with window {window}")
    if ("linear" in h.kinds) != bool(h.state):
        raise ProtocolError("header state must name a linear layer's tensors, and only then")
    if not isinstance(h.latent, tuple) or ("latent" in h.kinds) != bool(h.latent):
        raise ProtocolError("header latent must give a latent layer's widths, and only then")
    if h.latent:
        if len(h.latent) != 2:
            raise ProtocolError("header latent must be [latent width, rope key width]")
        for d in h.latent:
            check_uint(d, "header latent width", 1)


def _check_state(h: Header) -> None:
    """`state`: (name, dtype, shape) entries, distinct names, float dtypes, positive dims."""
    if not isinstance(h.state, tuple) or len(h.state) > MAX_STATE_TENSORS:
        raise ProtocolError(f"header state must be a list of at most {MAX_STATE_TENSORS}")
    names = set()
    for entry in h.state:
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise ProtocolError("header state entries must be [name, dtype, shape]")
        name, dtype, shape = entry
        if check_str(name, "header state name") in names or not name:
            raise ProtocolError(f"header state name {name!r} is empty or repeated")
        names.add(name)
        if dtype not in WIRE_DTYPES:
            raise ProtocolError(f"header state {name}: dtype {dtype!r} is not one of {WIRE_DTYPES}")
        if not isinstance(shape, tuple) or not 1 <= len(shape) <= MAX_STATE_DIMS:
            raise ProtocolError(f"header state {name}: shape must be 1 to {MAX_STATE_DIMS} dims")
        for d in shape:
            check_uint(d, f"header state {name} dimension", 1)


def layer_parts_to_numpy(frame: LayerFrame, header: Header) -> dict[str, np.ndarray]:
    """Every tensor of a layer frame by name (`Header.tensors`), as views of its buffer."""
    out = {}
    for name, (dtype, shape) in header.tensors(frame.layer).items():
        view = frame.parts[name]
        out[name] = np.frombuffer(view, np.uint8).view(_NUMPY_DTYPE[dtype]).reshape(shape)
    return out
