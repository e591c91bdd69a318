"""Reading a KV frame stream (nodes/contract/frames.py has the format) as it arrives.

`FrameReader` checks a stream as it is read in place, each payload straight into a buffer of
its own (`get_buffer`): the receive path copies no big chunk on the event loop. Every frame
is checked against the header before it is handed on; any break of the format raises
`ProtocolError`, and the reader stays failed.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from typing import Any

from tandem.nodes.contract.frames import (
    KIND_DONE,
    KIND_ERROR,
    KIND_HEADER,
    KIND_LAYER,
    LAYER_EXTRA_BYTES,
    MAX_JSON_BYTES,
    PREFIX,
    Done,
    ErrorFrame,
    Frame,
    Header,
    LayerFrame,
    ProtocolError,
    check_header,
    check_proto,
    check_str,
    check_uint,
    crc32,
    max_layer_payload,
)
from tandem.nodes.model.safetensors_format import parse_header


def _load_json(payload: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and bad JSON
        raise ProtocolError(f"{what} frame is not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} frame is not a JSON object")
    return obj


def _fields(obj: dict[str, Any], cls: type, what: str) -> dict[str, Any]:
    """The values of `cls`'s fields from a JSON object; extra keys are ignored."""
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [k for k in names if k not in obj]
    if missing:
        raise ProtocolError(f"{what} frame lacks {missing}")
    return {k: obj[k] for k in names}


class FrameReader:
    """Incremental, validating decoder that reads in place, as `asyncio.BufferedProtocol`
    does: `get_buffer()` says where the next bytes go (the rest of a prefix, or of a payload
    in a buffer of its own, from `alloc` for a layer), `buffer_updated(n)` says that n bytes
    landed there and returns the frames they complete; `finish()` at the end of the stream.
    """

    def __init__(
        self,
        max_layer_extra: int = LAYER_EXTRA_BYTES,
        alloc: Callable[[int], bytearray] = bytearray,
    ) -> None:
        self.max_layer_extra = max_layer_extra
        self.header: Header | None = None
        self.crc32 = 0
        self.next_layer = 0
        self.alloc = alloc
        self._prefix = bytearray(PREFIX.size)  # the pending prefix, `_prefix_n` bytes in
        self._prefix_n = 0
        self._pending: tuple[int, int] | None = None  # (kind, length) once a prefix is read
        self._target: memoryview | None = None  # the pending payload, `_filled` bytes in
        self._filled = 0
        self._payload_crc = 0  # the crc32 chain including the pending layer's bytes so far
        self._ended: Done | ErrorFrame | None = None
        self._failed = False

    @property
    def mid_frame(self) -> bool:
        """Whether some bytes of a frame not yet complete have been read."""
        return self._prefix_n > 0 or self._pending is not None

    def finish(self) -> None:
        """End of stream: raises ProtocolError unless it ended cleanly on done or error."""
        if self._failed:
            raise ProtocolError("reader already failed")
        if self.mid_frame:
            raise ProtocolError("stream ends inside a frame (truncated)")
        if self._ended is None:
            raise ProtocolError("stream ends without a done frame")

    def get_buffer(self) -> memoryview:
        """Where the stream's next bytes go (at least one byte; fill any part of it)."""
        if self._failed:
            raise ProtocolError("reader already failed")
        if self._ended is not None:
            return memoryview(self._prefix)  # whatever lands here is an error
        if self._pending is None:
            return memoryview(self._prefix)[self._prefix_n :]
        assert self._target is not None
        return self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """`nbytes` landed at the start of `get_buffer()`; return the frames they complete."""
        if self._failed:
            raise ProtocolError("reader already failed")
        try:
            frames: list[Frame] = []
            if nbytes and self._ended is not None:
                raise ProtocolError(f"data after the {self._end_name()} frame")
            if self._pending is None:
                if not self._prefix_got(nbytes):
                    return frames
                kind, n = self._pending  # type: ignore[misc]  # _prefix_got set it
                buffer = self.alloc(n) if kind == KIND_LAYER else bytearray(n)
                self._target = memoryview(buffer)[:n]  # a pooled buffer may be longer
                self._payload_got(self._target[:0], frames)  # an empty payload is complete
                return frames
            assert self._target is not None
            self._payload_got(self._target[self._filled : self._filled + nbytes], frames)
            return frames
        except ProtocolError:
            self._failed = True
            raise

    def _prefix_got(self, nbytes: int) -> bool:
        """`nbytes` more of the prefix are in: whether it is whole (then a payload is pending)."""
        if nbytes and self._prefix_n == 0:
            self._check_kind(self._prefix[0])  # fail on the first byte, not the ninth
        self._prefix_n += nbytes
        if self._prefix_n < PREFIX.size:
            return False
        kind, n = PREFIX.unpack_from(self._prefix)
        self._check_length(kind, n)  # before buffering any of the payload
        self._prefix_n = 0
        self._pending = (kind, n)
        self._filled, self._payload_crc = 0, self.crc32
        return True

    def _payload_got(self, piece: memoryview, frames: list[Frame]) -> None:
        """`piece`, the pending payload's next bytes, is in place; decode a complete frame."""
        assert self._pending is not None
        kind, n = self._pending
        if kind == KIND_LAYER and len(piece):
            self._payload_crc = crc32(piece, self._payload_crc)
        self._filled += len(piece)
        if self._filled < n:
            return
        assert self._target is not None
        payload, self._target = self._target, None
        self._pending = None
        frames.append(self._decode(kind, payload))

    def _end_name(self) -> str:
        return "done" if isinstance(self._ended, Done) else "error"

    def _check_kind(self, kind: int) -> None:
        if kind not in (KIND_HEADER, KIND_LAYER, KIND_DONE, KIND_ERROR):
            raise ProtocolError(f"unknown frame kind {kind}")
        if self.header is None and kind not in (KIND_HEADER, KIND_ERROR):
            raise ProtocolError(f"first frame must be a header, got kind {kind}")
        if self.header is not None and kind == KIND_HEADER:
            raise ProtocolError("a second header frame")

    def _check_length(self, kind: int, n: int) -> None:
        if kind == KIND_LAYER:
            assert self.header is not None  # _check_kind saw to it
            if self.next_layer >= self.header.layers:
                raise ProtocolError(f"more layers than the header's {self.header.layers}")
            limit = max_layer_payload(self.header, self.next_layer, self.max_layer_extra)
        else:
            limit = MAX_JSON_BYTES
        if n > limit:
            raise ProtocolError(f"oversized frame: kind {kind}, {n} bytes, limit {limit}")

    def _decode(self, kind: int, view: memoryview) -> Frame:
        if kind == KIND_LAYER:
            return self._decode_layer(view)
        payload = bytes(view)  # JSON: at most MAX_JSON_BYTES
        if kind == KIND_HEADER:
            obj = _load_json(payload, "header")
            check_proto(obj.get("proto"))  # first: another version may have other keys
            fields = _fields(obj, Header, "header")
            for name in ("kinds", "windows", "latent"):  # JSON lists; else the check fails
                fields[name] = tuple(v) if isinstance(v := fields[name], list) else v
            fields["state"] = _state(fields["state"])
            header = Header(**fields)
            check_header(header)
            self.header = header
            return header
        if kind == KIND_DONE:
            done = Done(**_fields(_load_json(payload, "done"), Done, "done"))
            check_uint(done.layers, "done layers")
            check_uint(done.crc32, "done crc32")
            assert self.header is not None
            if done.layers != self.header.layers or self.next_layer != self.header.layers:
                raise ProtocolError(
                    f"done after {self.next_layer} layers says {done.layers}, "
                    f"header says {self.header.layers}"
                )
            if done.crc32 != self.crc32:
                raise ProtocolError(f"crc32 mismatch: done says {done.crc32}, got {self.crc32}")
            self._ended = done
            return done
        error = ErrorFrame(**_fields(_load_json(payload, "error"), ErrorFrame, "error"))
        check_str(error.code, "error code")
        check_str(error.message, "error message")
        self._ended = error
        return error

    def _decode_layer(self, payload: memoryview) -> LayerFrame:
        h = self.header
        assert h is not None
        try:
            entries, metadata, data_start = parse_header(_blob_header(payload))
        # parse_header raises SafetensorsError (a ValueError) for what it checks; hostile
        # JSON can still surface as these (deep nesting, Infinity, metadata not an object).
        except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as e:
            raise ProtocolError(f"layer frame is not a safetensors blob ({e})") from None
        want = h.tensors(self.next_layer)  # _check_length saw that the layer is one
        if set(entries) != set(want):
            raise ProtocolError(f"layer blob holds {sorted(entries)}, want {sorted(want)}")
        for e in entries.values():
            dtype, shape = want[e.name]
            if e.dtype != dtype or e.shape != shape:
                raise ProtocolError(
                    f"layer tensor {e.name}: {e.dtype}{list(e.shape)}, "
                    f"header says {dtype}{list(shape)}"
                )
            if data_start + e.end > len(payload):
                raise ProtocolError(f"layer tensor {e.name} runs past the end of the blob")
        layer = metadata.get("layer")
        if layer is None:
            raise ProtocolError('layer blob lacks its {"layer": "i"} metadata')
        if layer != str(self.next_layer):
            raise ProtocolError(f"layer {layer!r} out of order, want {self.next_layer}")
        if self.next_layer >= h.layers:
            raise ProtocolError(f"more layers than the header's {h.layers}")
        self.crc32 = self._payload_crc
        self.next_layer += 1
        parts = {
            name: payload[data_start + e.begin : data_start + e.end] for name, e in entries.items()
        }
        return LayerFrame(self.next_layer - 1, payload, parts)


def _state(value: object) -> object:
    """A header's `state` from JSON lists to the tuples `Header` holds; a value of another
    form is left for `check_header` to refuse."""
    if not isinstance(value, list):
        return value
    out: list[object] = []
    for entry in value:
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list):
            out.append((entry[0], entry[1], tuple(entry[2])))
        else:
            out.append(entry)
    return tuple(out)


def _blob_header(payload: memoryview) -> bytes:
    """The leading bytes of a safetensors blob that hold its header (length and JSON)."""
    head = bytes(payload[:8])
    if len(head) < 8:
        return head  # parse_header says what is wrong
    (n,) = struct.unpack("<Q", head)
    return bytes(payload[: 8 + n]) if 8 + n <= len(payload) else head
