"""State frames (proto 4): a linear layer's fixed-size state beside full layers' K/V, named by
the header's `state` (nodes/contract/frames.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from tandem.nodes.contract.frame_reader import FrameReader
from tandem.nodes.contract.frames import (
    PROTO,
    FrameWriter,
    Header,
    LayerFrame,
    ProtocolError,
    encode_header,
    layer_parts_to_numpy,
    max_layer_payload,
)
from tandem.nodes.model.safetensors_format import nbytes_of

from tests.test_wire import decode_all, read_in_place

STATE = (("conv", "F32", (1, 3, 24)), ("recurrent", "F32", (1, 4, 8, 4)))
# layers 0, 1 linear, layer 2 full: three positions from 5
H = Header(PROTO, "fp", "r1", "F32", layers=3, start=5, count=3, n_kv_heads=2, head_dim=4,
           kinds=("linear", "linear", "full"), windows=(0, 0, 0), state=STATE)  # fmt: skip


def layer_tensors(h: Header, layer: int) -> dict[str, bytes]:
    rng = np.random.default_rng(layer)
    return {
        name: rng.integers(0, 256, nbytes_of(dtype, shape), dtype=np.uint8).tobytes()
        for name, (dtype, shape) in h.tensors(layer).items()
    }


def stream(h: Header) -> tuple[bytes, list[dict[str, bytes]]]:
    w = FrameWriter(h)
    sent = [layer_tensors(h, i) for i in range(h.layers)]
    frames = [w.start(), *(w.tensors(i, t) for i, t in enumerate(sent)), w.done()]
    return b"".join(frames), sent


def test_a_linear_layer_frame_holds_the_state_the_header_names() -> None:
    data, sent = stream(H)
    frames = decode_all(data, [7, 300, 301, 1000])
    header, *layers, _done = frames
    assert header == H
    assert [f.layer for f in layers if isinstance(f, LayerFrame)] == [0, 1, 2]
    for f, want in zip(layers, sent, strict=True):
        assert isinstance(f, LayerFrame)
        assert {n: bytes(v) for n, v in f.parts.items()} == want
    arrays = layer_parts_to_numpy(layers[0], H)  # type: ignore[arg-type]
    assert arrays["recurrent"].shape == (1, 4, 8, 4) and arrays["conv"].dtype == np.float32
    assert set(H.tensors(2)) == {"k", "v"} and H.shape(2) == (1, 2, 3, 4)
    assert H.positions(0) == 0 and not H.quantized(0)


def test_quantized_kv_leaves_the_state_in_its_own_dtype() -> None:
    h = dataclasses.replace(H, head_dim=64, kv_bits=8, kv_group_size=64)
    assert h.tensors(0) == {n: (d, s) for n, d, s in STATE}
    assert "k_scales" in h.tensors(2)
    data, _ = stream(h)
    assert len(decode_all(data)) == 5


def header_json(**change: object) -> bytes:
    obj = json.loads(encode_header(H)[9:])
    obj.update(change)
    payload = json.dumps(obj).encode()
    return bytes([1]) + len(payload).to_bytes(8, "little") + payload


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"state": []}, "header state must name a linear layer's tensors"),
        ({"kinds": ["full"] * 3, "windows": [0] * 3}, "and only then"),
        ({"state": [["conv", "F32", [1, 3]], ["conv", "F32", [2]]]}, "empty or repeated"),
        ({"state": [["conv", "U32", [1, 3]]]}, "dtype 'U32'"),
        ({"state": [["conv", "F32", [1, 0]]]}, "dimension must be an integer >= 1"),
        ({"state": [["conv", "F32", []]]}, "shape must be 1 to 8 dims"),
        ({"state": [["conv", "F32"]]}, "entries must be [name, dtype, shape]"),
        ({"state": "conv"}, "header state must be a list"),
        ({"state": [["c", "F32", [1]]] * 9}, "at most 8"),
        ({"kinds": ["linear", "linear", "linear2"]}, "kind 'linear2'"),
        ({"windows": [3, 0, 0]}, "kind 'linear' with window 3"),
    ],
)
def test_a_bad_state_header_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_in_place(FrameReader(), header_json(**change))


def test_a_state_frame_of_another_shape_is_refused() -> None:
    data, _ = stream(dataclasses.replace(H, state=(("conv", "F32", (1, 3, 24)),)))
    r = FrameReader()
    read_in_place(r, header_json())  # the header names conv and recurrent
    body = data[len(encode_header(dataclasses.replace(H, state=STATE[:1]))) :]
    with pytest.raises(ProtocolError, match="layer blob holds"):
        read_in_place(r, body)


def test_a_state_frame_is_bounded_by_its_tensors() -> None:
    want = sum(nbytes_of(d, s) for _, d, s in STATE)
    assert want < max_layer_payload(H, 0) <= want + 64 * 1024
    w = FrameWriter(H)
    w.start()
    with pytest.raises(ProtocolError, match="recurrent is missing"):
        w.tensors(0, {"conv": bytes(nbytes_of("F32", (1, 3, 24)))})
