"""KV frames (nodes/contract/frames.py) that are malformed: bad blobs, headers, lengths and
order are refused, and random or corrupted bytes only ever raise ProtocolError."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tandem.nodes.contract.frame_reader import FrameReader
from tandem.nodes.contract.frames import (
    PROTO,
    FrameWriter,
    Header,
    ProtocolError,
    encode_done,
    encode_error,
    encode_header,
    max_layer_payload,
)

from tests.test_wire import (
    FAST,
    SLIDING,
    H,
    blob,
    decode_all,
    encode_layer,
    frame,
    kv_bytes,
    make_stream,
    read_in_place,
)

# --- malformed streams -----------------------------------------------------------------------


def _layer(i: int, h: Header = H, **change: object) -> bytes:
    """Layer frame `i` written as if the header were `h` with `change`."""
    h2 = dataclasses.replace(h, **change)
    return encode_layer(i, *kv_bytes(h2, i), h2)


def _crc(*frames: bytes) -> int:
    crc = 0
    for f in frames:
        crc = zlib.crc32(f[9:], crc)
    return crc


def _good_layers(n: int = 3) -> bytes:
    return b"".join(_layer(i) for i in range(n))


def _header_json(**change: object) -> bytes:
    return frame(1, json.dumps({**dataclasses.asdict(H), **change}).encode())


_KV_JSON = '"dtype":"F32","shape":[1,2,5,4]'  # H.shape in F32: 160 bytes each
_BAD_BLOBS = {
    "blob not safetensors": b"garbage!" * 4,
    "blob too short": b"\x01\x02",
    "blob header not json": blob(b"{nope"),
    "blob missing v": blob(
        b'{"__metadata__":{"layer":"0"},"k":{' + _KV_JSON.encode() + b',"data_offsets":[0,160]}}',
        bytes(160),
    ),
    "blob extra tensor": blob(
        (
            '{"__metadata__":{"layer":"0"},'
            f'"k":{{{_KV_JSON},"data_offsets":[0,160]}},"v":{{{_KV_JSON},"data_offsets":[160,320]}},'
            '"x":{"dtype":"U8","shape":[1],"data_offsets":[320,321]}}'
        ).encode(),
        bytes(321),
    ),
    "blob data past end": _layer(0)[9:-1],
    "blob metadata a list": blob(b'{"__metadata__":[1]}'),
    "blob infinite shape": blob(b'{"k":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}}'),
    "blob deep nesting": blob(b'{"k":' + b"[" * 20000),
    "blob no layer metadata": blob(
        (
            f'{{"k":{{{_KV_JSON},"data_offsets":[0,160]}},'
            f'"v":{{{_KV_JSON},"data_offsets":[160,320]}}}}'
        ).encode(),
        bytes(320),
    ),
}

MALFORMED: dict[str, bytes] = {
    "empty stream": b"",
    "bad kind": b"\x07" + bytes(8),
    "kind zero": bytes(9),
    "garbage bytes": b"\xde\xad\xbe\xef garbage",
    "layer before header": _layer(0) + encode_header(H),
    "done before header": encode_done(0, 0),
    "huge header length": b"\x01" + struct.pack("<Q", 2**63),
    "header json too long": b"\x01" + struct.pack("<Q", 64 * 1024 + 1),
    "header not json": frame(1, b"{not json"),
    "header not utf8": frame(1, b"\xff\xfe\x00"),
    "header json array": frame(1, b"[1, 2]"),
    "header deep nesting": frame(1, b"[" * 60000),
    "header missing key": frame(1, json.dumps({"proto": PROTO, "dtype": "F32"}).encode()),
    "other proto version": _header_json(proto=1),
    "proto missing": frame(1, b'{"dtype":"F32"}'),
    "proto is true": _header_json(proto=True),
    "header unknown dtype": _header_json(dtype="F64"),
    "header negative count": _header_json(count=-1),
    "header zero layers": _header_json(layers=0),
    "header string size": _header_json(head_dim="4"),
    "header nested fingerprint": _header_json(fingerprint=[[[]]]),
    "kinds not a list": _header_json(kinds="full", windows=[]),
    "kinds for fewer layers": _header_json(kinds=["full"], windows=[0]),
    "unknown layer kind": _header_json(kinds=["full", "linear", "full"], windows=[0, 0, 0]),
    "sliding without a window": _header_json(kinds=["full", "sliding", "full"], windows=[0] * 3),
    "full with a window": _header_json(kinds=["full", "full", "full"], windows=[0, 4, 0]),
    "negative window": _header_json(kinds=["sliding"] * 3, windows=[4, -1, 4]),
    "full-length sliding frame": encode_header(SLIDING) + _layer(0, count=5),
    "second header": encode_header(H) + encode_header(H),
    "truncated prefix": encode_header(H)[:5],
    "truncated payload": encode_header(H) + _layer(0)[:-1],
    "no done frame": encode_header(H) + _good_layers(),
    "dtype mismatch": encode_header(H) + _layer(0, dtype="F16", head_dim=8),
    "shape mismatch": encode_header(H) + _layer(0, count=4),
    "layer out of order": encode_header(H) + _layer(1),
    "layer repeated": encode_header(H) + _layer(0) + _layer(0),
    "too many layers": encode_header(H) + _good_layers() + _layer(3),
    "oversized layer": encode_header(H) + b"\x02" + struct.pack("<Q", max_layer_payload(H, 0) + 1),
    "crc mismatch": encode_header(H) + _good_layers() + encode_done(3, _crc(_good_layers()) ^ 1),
    "done early": encode_header(H) + _good_layers(2) + encode_done(2, 0),
    "done wrong count": encode_header(H) + _good_layers() + encode_done(4, 0),
    "done bad json": encode_header(H) + _good_layers() + frame(3, b'{"layers":3}'),
    "done crc a string": encode_header(H) + _good_layers() + frame(3, b'{"layers":3,"crc32":"0"}'),
    "frame after done": make_stream(H)[0] + encode_header(H),
    "byte after done": make_stream(H)[0] + b"\x00",
    "frame after error": encode_header(H) + encode_error("e", "m") + _layer(0),
    "error code not str": frame(4, b'{"code":[1],"message":"m"}'),
    **{name: encode_header(H) + frame(2, b) for name, b in _BAD_BLOBS.items()},
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_raises(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_all(data)


def test_malformed_messages() -> None:
    def err(name: str) -> str:
        with pytest.raises(ProtocolError) as e:
            decode_all(MALFORMED[name])
        return str(e.value)

    assert f"protocol version 1, this node speaks {PROTO}" in err("other proto version")
    assert "unknown frame kind 7" in err("bad kind")
    assert "truncated" in err("truncated payload")
    assert "without a done" in err("no done frame")
    assert "crc32 mismatch" in err("crc mismatch")
    assert "oversized" in err("oversized layer")
    assert "out of order" in err("layer out of order")
    assert "F16" in err("dtype mismatch")
    assert "[1, 2, 4, 4]" in err("shape mismatch")


def test_length_checked_before_buffering() -> None:
    r = FrameReader()
    read_in_place(r, encode_header(H))
    with pytest.raises(ProtocolError, match="oversized"):
        read_in_place(
            r, b"\x02" + struct.pack("<Q", max_layer_payload(H, 0) + 1)
        )  # the prefix alone
    r = FrameReader(max_layer_extra=0)  # no room for the blob's own header
    read_in_place(r, encode_header(H))
    with pytest.raises(ProtocolError, match="oversized"):
        read_in_place(r, _layer(0))


def test_bad_kind_fails_on_first_byte() -> None:
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        read_in_place(FrameReader(), b"\x05")


def test_writer_enforces_order() -> None:
    k, v = kv_bytes(H, 0)
    w = FrameWriter(H)
    with pytest.raises(ProtocolError):
        w.layer(0, k, v)  # before the header
    w.start()
    with pytest.raises(ProtocolError):
        w.start()
    with pytest.raises(ProtocolError):
        w.layer(1, k, v)
    with pytest.raises(ProtocolError):
        w.done()  # layers missing
    with pytest.raises(ProtocolError, match="bytes"):
        w.layer(0, k[:-1], v)
    for i in range(3):
        w.layer(i, k, v)
    with pytest.raises(ProtocolError):
        w.layer(3, k, v)
    w.done()
    with pytest.raises(ProtocolError):
        w.error("late", "after done")
    with pytest.raises(ProtocolError, match="dtype"):
        FrameWriter(dataclasses.replace(H, dtype="F64"))
    with pytest.raises(ProtocolError, match="protocol version"):
        FrameWriter(dataclasses.replace(H, proto=PROTO + 1))
    for group in ("junk", -1, 64):  # a full-precision header names no group size
        with pytest.raises(ProtocolError, match="kv_group_size"):
            FrameWriter(dataclasses.replace(H, kv_group_size=group))


# --- random and corrupted bytes --------------------------------------------------------------


def _decode_or_protocol_error(data: bytes, cuts: list[int]) -> None:
    with contextlib.suppress(ProtocolError):
        decode_all(data, cuts)


@FAST
@given(
    data=st.binary(max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=5),
)
def test_random_bytes_only_raise_protocol_error(data: bytes, cuts: list[int]) -> None:
    _decode_or_protocol_error(data, [c for c in cuts if c <= len(data)])


_VALID = make_stream(dataclasses.replace(H, layers=2, count=2, n_kv_heads=1, head_dim=2))[0]


@FAST
@given(
    edits=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, len(_VALID)),
    tail=st.binary(max_size=16),
)
def test_corrupted_stream_only_raises_protocol_error(
    edits: list[tuple[int, int]], cut: int, tail: bytes
) -> None:
    data = bytearray(_VALID)
    for i, b in edits:
        data[i] = b
    _decode_or_protocol_error(bytes(data[:cut]) + tail, [])
