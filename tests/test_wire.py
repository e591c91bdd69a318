"""KV frames (nodes/contract/frames.py): exact bytes, round trips, mx.load (malformed streams:
test_wire_malformed.py)."""

from __future__ import annotations

import dataclasses
import itertools
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem.nodes.contract.frame_reader import FrameReader
from tandem.nodes.contract.frames import (
    PROTO,
    Done,
    ErrorFrame,
    Frame,
    FrameWriter,
    Header,
    LayerFrame,
    ProtocolError,
    encode_done,
    encode_error,
    encode_header,
    encode_tensors,
    layer_parts_to_numpy,
    max_layer_payload,
)


def encode_layer(
    layer: int,
    k: bytes | memoryview,
    v: bytes | memoryview,
    header: Header,
    quantized: dict[str, bytes | memoryview] | None = None,
) -> bytes:
    """The whole frame for one layer's K and V (`encode_tensors` with "k", "v" and a quantized
    header's scales and biases).

    `k` and `v` hold `header.shape(layer)` in `header.dtype`, row-major: bytes or any C-contiguous
    buffer (a numpy array; a torch bf16 tensor as `t.view(torch.uint16).numpy()`). For a
    quantized header, `k` and `v` are the packed words and `quantized` holds the scales and
    biases (`k_scales`, `k_biases`, `v_scales`, `v_biases`).
    """
    return encode_tensors(layer, {"k": k, "v": v, **(quantized or {})}, header)


def layer_to_numpy(frame: LayerFrame, header: Header) -> tuple[np.ndarray, np.ndarray]:
    """K and V as numpy arrays `[1, n_kv_heads, count, head_dim]` (float headers): views of
    the frame's buffer, with no copy (copy them, as `mx.array` does, before that buffer is
    reused). numpy has no bfloat16: BF16 comes back as uint16 holding the raw bits; turn it
    into bf16 with `mx.array(a).view(mx.bfloat16)`."""
    parts = layer_parts_to_numpy(frame, header)
    return parts["k"], parts["v"]


H = Header(PROTO, "fp", "r1", "F32", layers=3, start=0, count=5, n_kv_heads=2, head_dim=4)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# layer 0 keeps a window of 2 of the 5 new positions: its frame holds only those
SLIDING = dataclasses.replace(H, kinds=("sliding", "full", "full"), windows=(2, 0, 0))


def kv_bytes(h: Header, layer: int) -> tuple[bytes, bytes]:
    """Random K and V bytes of a layer's shape and dtype (any bit pattern, NaNs included)."""
    n = 2 * int(np.prod(h.shape(layer))) * {"F32": 4, "F16": 2, "BF16": 2}[h.dtype]
    raw = np.random.default_rng(layer).integers(0, 256, n, dtype=np.uint8).tobytes()
    return raw[: n // 2], raw[n // 2 :]


def make_stream(h: Header, end: str = "done") -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A whole valid stream and the K/V bytes it carries."""
    w = FrameWriter(h)
    parts, kvs = [w.start()], []
    for i in range(h.layers):
        k, v = kv_bytes(h, i)
        kvs.append((k, v))
        parts.append(w.layer(i, k, v))
    parts.append(w.done() if end == "done" else w.error("oom", "out of memory"))
    return b"".join(parts), kvs


def read_in_place(r: FrameReader, chunk: bytes, reads: list[int] | None = None) -> list[Frame]:
    """Give `chunk` to `r` as `recv_into` would: into the reader's own buffers, each read as
    much as the buffer takes (its size appended to `reads`)."""
    frames: list[Frame] = []
    pos = 0
    while pos < len(chunk):
        view = r.get_buffer()
        n = min(len(view), len(chunk) - pos)
        view[:n] = chunk[pos : pos + n]
        pos += n
        frames += r.buffer_updated(n)
        if reads is not None:
            reads.append(n)
    return frames


def decode_all(data: bytes, chunks: list[int] | None = None) -> list[Frame]:
    """Read `data` into the reader's buffers as it would arrive, cut at the offsets in
    `chunks` (or whole), then finish."""
    r = FrameReader()
    cuts = [0, *sorted(chunks or []), len(data)]
    frames: list[Frame] = []
    for a, b in itertools.pairwise(cuts):
        frames += read_in_place(r, data[a:b])
    r.finish()
    return frames


def frame(kind: int, payload: bytes) -> bytes:
    return bytes([kind]) + struct.pack("<Q", len(payload)) + payload


def blob(header_json: bytes, data: bytes = b"") -> bytes:
    """A hand-made safetensors blob (no padding, no checks)."""
    return struct.pack("<Q", len(header_json)) + header_json + data


# --- exact bytes -----------------------------------------------------------------------------


def test_header_frame_bytes() -> None:
    h = Header(PROTO, "fp", "r1", "F32", layers=2, start=0, count=1, n_kv_heads=1, head_dim=2,
               kinds=("sliding", "full"), windows=(4, 0))  # fmt: skip
    body = (
        b'{"proto":5,"fingerprint":"fp","request_id":"r1","dtype":"F32","layers":2,'
        b'"start":0,"count":1,"n_kv_heads":1,"head_dim":2,"kv_bits":0,"kv_group_size":0,'
        b'"kinds":["sliding","full"],"windows":[4,0],"state":[],"latent":[]}'
    )
    assert encode_header(h) == b"\x01\xd9\x00\x00\x00\x00\x00\x00\x00" + body
    assert len(body) == 0xD9


def test_a_sliding_layer_crosses_as_its_window_of_positions() -> None:
    data, kvs = make_stream(SLIDING)
    frames = decode_all(data, [len(data) // 3])
    header, layers = frames[0], frames[1:-1]
    assert header == SLIDING and isinstance(header, Header)
    assert [len(x.k) // (2 * 4 * 4) for x in layers] == [2, 5, 5]  # positions: F32, D 4, 2 heads
    assert [(bytes(x.k), bytes(x.v)) for x in layers] == kvs
    k, _ = layer_to_numpy(layers[0], header)
    assert k.shape == (1, 2, 2, 4)
    # a window longer than the prompt: every new position, as a full layer
    assert dataclasses.replace(SLIDING, windows=(9, 0, 0)).shape(0) == (1, 2, 5, 4)


def test_quantized_kv_leaves_sliding_layers_in_float() -> None:
    h = dataclasses.replace(SLIDING, head_dim=64, kv_bits=8, kv_group_size=64)
    assert set(h.tensors(0)) == {"k", "v"} and h.tensors(0)["k"] == ("F32", (1, 2, 2, 64))
    assert h.tensors(1)["k"] == ("U32", (1, 2, 5, 16)) and "k_scales" in h.tensors(1)
    k_and_v = 2 * 2 * 64  # heads x head_dim, twice
    assert max_layer_payload(h, 0, extra=0) == k_and_v * 2 * 4  # 2 positions in F32
    assert max_layer_payload(h, 1, extra=0) == k_and_v * 5 * (1 + 2 * 4 / 64)  # 8 bits + scales


def test_layer_frame_bytes() -> None:
    h = Header(PROTO, "fp", "r1", "F32", layers=1, start=0, count=1, n_kv_heads=1, head_dim=2)
    f = encode_layer(0, struct.pack("<2f", 1, 2), struct.pack("<2f", 3, 4), h)
    st_header = (
        b'{"__metadata__":{"layer":"0"},'
        b'"k":{"dtype":"F32","shape":[1,1,1,2],"data_offsets":[0,8]},'
        b'"v":{"dtype":"F32","shape":[1,1,1,2],"data_offsets":[8,16]}}   '  # padded to 8
    )
    data = b"\x00\x00\x80?\x00\x00\x00@\x00\x00@@\x00\x00\x80@"  # 1.0 2.0 3.0 4.0 as <f4
    assert f[:9] == b"\x02\xb0\x00\x00\x00\x00\x00\x00\x00"  # kind 2, 176-byte payload
    assert f[9:17] == b"\x98\x00\x00\x00\x00\x00\x00\x00"  # 152-byte safetensors header
    assert f[17:] == st_header + data
    assert len(f) == 9 + 176


def test_done_and_error_frame_bytes() -> None:
    assert encode_done(2, 0xDEADBEEF) == (
        b"\x03\x1f\x00\x00\x00\x00\x00\x00\x00" + b'{"layers":2,"crc32":3735928559}'
    )
    assert encode_error("oom", "x") == (
        b"\x04\x1c\x00\x00\x00\x00\x00\x00\x00" + b'{"code":"oom","message":"x"}'
    )


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_round_trip(dtype: str) -> None:
    h = dataclasses.replace(H, dtype=dtype)
    data, kvs = make_stream(h)
    frames = decode_all(data)
    assert frames[0] == h
    layers = frames[1:-1]
    assert [f.layer for f in layers if isinstance(f, LayerFrame)] == [0, 1, 2]
    crc = 0
    for f, (k, v) in zip(layers, kvs, strict=True):
        assert isinstance(f, LayerFrame)
        assert bytes(f.k) == k and bytes(f.v) == v  # raw bits, NaN payloads included
        crc = zlib.crc32(bytes(f.payload), crc)
        nk, nv = layer_to_numpy(f, h)
        assert nk.shape == nv.shape == (1, 2, 5, 4)
        assert nk.dtype == {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[dtype]
        assert nk.tobytes() == k and nv.tobytes() == v
    assert frames[-1] == Done(3, crc)


def test_bf16_is_never_widened() -> None:
    h = dataclasses.replace(H, dtype="BF16", layers=1, count=1, n_kv_heads=1, head_dim=4)
    bits = np.array([[[[0x3F80, 0x7FC1, 0xFF81, 0x0001]]]], dtype="<u2")  # 1.0, NaNs, denormal
    w = FrameWriter(h)
    data = w.start() + w.layer(0, bits, bits[..., ::-1].copy()) + w.done()
    lkv = decode_all(data)[1]
    assert isinstance(lkv, LayerFrame)
    k, v = layer_to_numpy(lkv, h)
    assert k.tolist() == bits.tolist() and v.tolist() == bits[..., ::-1].tolist()


def test_one_byte_at_a_time() -> None:
    data, _ = make_stream(H)
    r = FrameReader()
    frames: list[Frame] = []
    for i in range(len(data)):
        frames += read_in_place(r, data[i : i + 1])
    r.finish()
    assert frames == decode_all(data)
    assert [type(f) for f in frames] == [Header, LayerFrame, LayerFrame, LayerFrame, Done]


def test_mid_frame() -> None:
    data, _ = make_stream(H)
    r = FrameReader()
    assert not r.mid_frame
    cut = len(encode_header(H)) + 3  # the header and 3 bytes of the first layer frame
    assert len(read_in_place(r, data[:cut])) == 1 and r.mid_frame
    read_in_place(r, data[cut:])
    assert not r.mid_frame


def test_in_place_layers_land_in_buffers_from_alloc() -> None:
    """Read in place, a layer's payload is the buffer `alloc` gave (one piece, no copy),
    even a longer one, as a pool may give; JSON frames get buffers of their own."""
    h = dataclasses.replace(H, count=64)
    data, kvs = make_stream(h)
    given: list[bytearray] = []

    def alloc(n: int) -> bytearray:
        given.append(bytearray(n + 100))
        return given[-1]

    r = FrameReader(alloc=alloc)
    frames = read_in_place(r, data)
    r.finish()
    layers = [f for f in frames if isinstance(f, LayerFrame)]
    assert [(bytes(f.k), bytes(f.v)) for f in layers] == kvs
    assert len(given) == h.layers
    for f, buffer in zip(layers, given, strict=True):
        assert f.payload.obj is buffer
        assert len(f.payload) == len(buffer) - 100
    assert frames == decode_all(data)


def test_in_place_reads_take_one_frame_at_a_time() -> None:
    """`get_buffer` never reaches past the frame in progress: a read into it cannot take
    bytes of the next frame, so each read's time belongs to one frame."""
    data, _ = make_stream(H)
    r = FrameReader()
    reads: list[int] = []
    frames = read_in_place(r, data, reads)
    assert len(frames) == 2 + H.layers
    assert len(reads) == 2 * len(frames)  # a prefix, then a payload: each read whole
    with pytest.raises(ProtocolError, match="after the done"):
        r.buffer_updated(len(r.get_buffer()))
    with pytest.raises(ProtocolError, match="already failed"):
        r.get_buffer()


def test_layer_to_numpy_views_a_buffer_read_in_place() -> None:
    h = dataclasses.replace(H, layers=1, count=16384)  # 512 KiB each of K and V
    data, kvs = make_stream(h)
    lkv = next(f for f in read_in_place(FrameReader(), data) if isinstance(f, LayerFrame))
    k, v = layer_to_numpy(lkv, h)
    assert np.shares_memory(k, np.frombuffer(lkv.payload, np.uint8))  # no copy
    assert (k.tobytes(), v.tobytes()) == kvs[0] and k.shape == h.shape(0)
    cuts = list(range(0, len(data), 200_000))  # as received: K and V straddle reads
    read = next(f for f in decode_all(data, cuts) if isinstance(f, LayerFrame))
    assert layer_to_numpy(read, h)[0].tobytes() == kvs[0][0]


def test_error_frame_ends_the_stream() -> None:
    data, _ = make_stream(H, end="error")
    frames = decode_all(data)
    assert frames[-1] == ErrorFrame("oom", "out of memory")
    assert decode_all(encode_error("busy", "later")) == [ErrorFrame("busy", "later")]
    with pytest.raises(ProtocolError, match="after"):
        decode_all(data + encode_done(3, 0))


def test_reader_stays_failed() -> None:
    r = FrameReader()
    with pytest.raises(ProtocolError):
        read_in_place(r, b"\x09")
    with pytest.raises(ProtocolError, match="already failed"):
        read_in_place(r, encode_header(H))
    with pytest.raises(ProtocolError, match="already failed"):
        r.finish()


def test_zero_token_layers() -> None:
    h = dataclasses.replace(H, count=0)
    data, _ = make_stream(h)
    frames = decode_all(data)
    assert all(len(f.k) == 0 for f in frames if isinstance(f, LayerFrame))


# --- streams ---------------------------------------------------------------------------------


# --- properties ------------------------------------------------------------------------------

headers = st.builds(
    Header,
    proto=st.just(PROTO),
    fingerprint=st.text(max_size=8),
    request_id=st.text(max_size=8),
    dtype=st.sampled_from(["F32", "F16", "BF16"]),
    layers=st.integers(1, 3),
    start=st.integers(0, 2**40),
    count=st.integers(0, 3),
    n_kv_heads=st.integers(1, 2),
    head_dim=st.integers(1, 3),
)


@FAST
@given(h=headers, end=st.sampled_from(["done", "error"]), data=st.data())
def test_any_chunking_decodes_the_same(h: Header, end: str, data: st.DataObject) -> None:
    stream, kvs = make_stream(h, end)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    frames = decode_all(stream, cuts)
    assert frames[0] == h
    got = [(bytes(f.k), bytes(f.v)) for f in frames if isinstance(f, LayerFrame)]
    assert got == kvs
    assert isinstance(frames[-1], Done if end == "done" else ErrorFrame)
    assert frames == decode_all(stream)


# --- the decode side's view ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_mx_load_reads_a_layer_payload(dtype: str, tmp_path: Path) -> None:
    mx = pytest.importorskip("mlx.core")
    h = dataclasses.replace(H, dtype=dtype)
    lkv = next(f for f in decode_all(make_stream(h)[0]) if isinstance(f, LayerFrame))
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(lkv.payload))
    arrays, metadata = mx.load(str(path), return_metadata=True)
    assert metadata == {"layer": "0"}
    want_dtype = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[dtype]
    bits = mx.uint32 if dtype == "F32" else mx.uint16
    for name, want in zip("kv", layer_to_numpy(lkv, h), strict=True):
        a = arrays[name]
        assert a.shape == (1, 2, 5, 4) and a.dtype == want_dtype
        got = np.array(a.view(bits))  # compare bits: NaN payloads must survive too
        assert got.tobytes() == want.tobytes()
    if dtype != "BF16":
        np.testing.assert_array_equal(np.array(arrays["k"]), layer_to_numpy(lkv, h)[0])


def test_wire_imports_no_framework() -> None:
    code = (
        "import sys, tandem.nodes.contract.frames; "
        "bad = {m.split('.')[0] for m in sys.modules} & {'torch', 'mlx', 'aiohttp', 'mlx_lm'}; "
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_frame_crc_is_zlibs_crc32() -> None:
    """The fast crc32 the frames use (ISA-L) is zlib's function, chained the same way."""
    from tandem.nodes.contract import frames as wire

    data = np.random.default_rng(7).integers(0, 256, 3_000_001, dtype=np.uint8).tobytes()
    assert wire.crc32(data) == zlib.crc32(data)
    assert wire.crc32(data[1000:], wire.crc32(data[:1000])) == zlib.crc32(data)
