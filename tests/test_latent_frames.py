"""Latent frames (proto 5): a multi-head latent attention layer's latents and rope keys (DeepSeek
V3), `k` [1, 1, count, latent] and `v` [1, 1, count, rope] as mlx-lm's cache holds them, named
by the header's `latent` (nodes/contract/frames.py)."""

from __future__ import annotations

import dataclasses

import pytest
from tandem.nodes.contract.frames import PROTO, Header, LayerFrame, ProtocolError, encode_header

from tests.test_state_frames import stream
from tests.test_wire import decode_all

H = Header(PROTO, "fp", "r1", "BF16", layers=2, start=4, count=3, n_kv_heads=1, head_dim=24,
           kinds=("latent", "latent"), windows=(0, 0), latent=(32, 8))  # fmt: skip


def test_a_latent_layer_frame_holds_its_latents_and_rope_keys() -> None:
    data, sent = stream(H)
    header, *layers, _done = decode_all(data, [5, 99, 400])
    assert header == H and PROTO == 5
    assert H.tensors(0) == {"k": ("BF16", (1, 1, 3, 32)), "v": ("BF16", (1, 1, 3, 8))}
    for f, want in zip(layers, sent, strict=True):
        assert isinstance(f, LayerFrame)
        assert {n: bytes(v) for n, v in f.parts.items()} == want
    assert not H.quantized(0)  # float only


@pytest.mark.parametrize(
    "bad",
    [
        {"latent": ()},  # latent layers without their widths
        {"latent": (32,)},
        {"latent": (32, 0)},
        {"kinds": ("full", "full"), "latent": (32, 8)},  # widths without latent layers
    ],
)
def test_a_header_with_malformed_latent_widths_is_refused(bad: dict[str, object]) -> None:
    frame = encode_header(dataclasses.replace(H, **bad))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="latent"):
        decode_all(frame, [len(frame)])
