"""Quantized KV frames (issue 20): packed words, scales and biases round-trip into mlx caches."""

from __future__ import annotations

import dataclasses
import json
import struct

import mlx.core as mx
import numpy as np
import pytest
import torch
from tandem.nodes.contract.frames import FrameWriter, Header, LayerFrame, ProtocolError
from tandem.nodes.contract.http import PROTO, KVFormat, kv_format_of
from tandem.nodes.decode.families.base import KVShape
from tandem.nodes.decode.prompt_cache import PromptCache
from tandem.nodes.decode.remote import CacheBuilder
from tandem.nodes.prefill.handover import quantized_parts

from tests.test_wire import decode_all

H = Header(PROTO, "fp", "r", "F32", layers=1, start=0, count=3, n_kv_heads=2, head_dim=64,
           kv_bits=8, kv_group_size=64)  # fmt: skip


def quantized_layer(h: Header, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h.shape(0), generator=g)
    v = torch.randn(h.shape(0), generator=g)
    fmt = KVFormat(h.kv_bits, h.kv_group_size)
    return k, v, quantized_parts(k, v, fmt)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


# ---------------------------------------------------------------- frames


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_frames_round_trip_into_a_quantized_cache(bits: int) -> None:
    """A layer's packed words, scales and biases cross the wire and land in a QuantizedKVCache
    holding exactly what mx.quantize makes of the same K and V."""
    h = dataclasses.replace(H, kv_bits=bits)
    k, _, parts = quantized_layer(h)
    writer = FrameWriter(h)
    named = {n: raw(t) for n, t in parts.items()}
    stream = writer.start() + writer.layer(0, named.pop("k"), named.pop("v"), named)
    stream += writer.done()
    frames = decode_all(stream)
    layer = next(f for f in frames if isinstance(f, LayerFrame))
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    caches = [KVCache()]
    fmt = KVFormat(bits, 64)
    builder = CacheBuilder(frames[0], caches, KVShape(1, 2, 64, "F32"), 0, 3, fmt)
    builder.add(layer)
    assert isinstance(caches[0], QuantizedKVCache) and caches[0].offset == 3
    want = mx.quantize(mx.array(k.numpy()), group_size=64, bits=bits)
    got = caches[0].state[0]
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(np.array(a[..., :3, :]), np.array(b))


def test_the_prompt_cache_keeps_each_form_apart() -> None:
    """A turn in one KV form neither serves nor evicts a conversation held in another."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    def held(n: int, fmt: KVFormat | None) -> list[object]:
        c = KVCache() if fmt is None else QuantizedKVCache(fmt.group_size, fmt.bits)
        x = mx.random.normal((1, 1, n, 64))
        c.update_and_fetch(x, x)
        return [c]

    cache, q8, q4 = PromptCache(), KVFormat(8), KVFormat(4)
    cache.store(list(range(10)), held(10, None))
    cache.store(list(range(12)), held(12, q8))  # longer, in another form
    cache.store(list(range(10)), held(10, q4))  # the same tokens, in a third
    assert cache.lookup(list(range(20)), None)[0] == 10
    assert cache.lookup(list(range(20)), q8)[0] == 12
    assert cache.lookup(list(range(20)), q4)[0] == 10
    assert cache.lookup(list(range(20)), KVFormat(8, 32)) == (0, None)
    cache.store(list(range(15)), held(15, q8))  # its own form's shorter prefix goes
    assert len(cache._entries) == 3 and cache.lookup(list(range(20)), q8)[0] == 15


def test_packed_shapes_that_disagree_with_the_header_are_a_protocol_error() -> None:
    _, _, parts = quantized_layer(H)
    writer = FrameWriter(H)
    start = writer.start()
    # a blob whose words are shaped for 4 bits under an 8-bit header
    four = dataclasses.replace(H, kv_bits=4)
    _, _, small = quantized_layer(four)
    named = {n: raw(t) for n, t in small.items()}
    bad = FrameWriter(four)
    bad.start()
    frame = bad.layer(0, named.pop("k"), named.pop("v"), named)
    with pytest.raises(ProtocolError, match="header says"):
        decode_all(start + frame)
    with pytest.raises(ProtocolError, match="missing"):
        writer.layer(0, raw(parts["k"]), raw(parts["v"]))  # no scales and biases


def test_a_header_in_another_format_than_asked_is_refused() -> None:
    from mlx_lm.models.cache import KVCache

    with pytest.raises(ProtocolError, match="asked for"):
        CacheBuilder(H, [KVCache()], KVShape(1, 2, 64, "F32"), 0, 3, None)
    with pytest.raises(ProtocolError, match="asked for"):
        CacheBuilder(H, [KVCache()], KVShape(1, 2, 64, "F32"), 0, 3, KVFormat(4, 64))


@pytest.mark.parametrize(
    "obj", [{"kv_bits": 3}, {"kv_bits": "8"}, {"kv_bits": 8, "kv_group_size": 48},
            {"kv_group_size": 64}, {"kv_bits": True}],
)  # fmt: skip
def test_unsupported_formats_are_refused(obj: dict) -> None:
    with pytest.raises(ValueError):
        kv_format_of(obj)


def test_bytes_on_the_wire_per_token() -> None:
    """70B-shaped: 80 layers, 8 KV heads, head_dim 128, bf16 (320 KiB/token at 16 bits)."""
    shape = KVShape(80, 8, 128, "BF16")
    full = shape.bytes_per_token(None)
    assert full == 327_680
    assert shape.bytes_per_token(KVFormat(8, 64)) / full == pytest.approx(0.53125)  # ≤ 0.54
    assert shape.bytes_per_token(KVFormat(4, 64)) / full == pytest.approx(0.28125)  # ≤ 0.29


def test_frame_layout_is_the_documented_one() -> None:
    """A quantized layer blob names its tensors k, k_scales, k_biases, v, v_scales, v_biases;
    words are U32 [1, kv heads, count, head_dim * bits / 32]."""
    _, _, parts = quantized_layer(H)
    named = {n: raw(t) for n, t in parts.items()}
    w = FrameWriter(H)
    w.start()
    frame = w.layer(0, named.pop("k"), named.pop("v"), named)
    (n,) = struct.unpack("<Q", frame[9:17])
    header = json.loads(frame[17 : 17 + n])
    assert set(header) - {"__metadata__"} == {"k", "k_scales", "k_biases", "v", "v_scales",
                                              "v_biases"}  # fmt: skip
    assert header["k"]["dtype"] == "U32" and header["k"]["shape"] == [1, 2, 3, 16]
    assert header["k_scales"]["shape"] == [1, 2, 3, 1] and header["k_scales"]["dtype"] == "F32"
