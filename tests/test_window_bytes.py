"""Issue 35 item 6: K/V bytes on the wire count a sliding layer's window, not the prompt, in
the one count (`nodes/model/kv_bytes.py`) that `tandem plan` and the router both use."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tandem.app.cli.main import main
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode.router import LocalRate, choose
from tandem.nodes.model.kv_bytes import TokenBytes, kv_bytes
from tandem.nodes.model.spec import FULL, LayerKind, ModelSpec

from tests.conftest import MakeTiny

# Gemma-3-270M's attention: 18 layers, 1 KV head of 256, window 512, every 6th layer global
LAYERS, KV_HEADS, HEAD_DIM, WINDOW, PATTERN = 18, 1, 256, 512, 6
GLOBAL = [i for i in range(LAYERS) if (i + 1) % PATTERN == 0]  # 5, 11, 17
HW = ["--device", "cpu", "--budget", "1GiB", "--pcie-gbps", "100", "--disk-gbps", "10",
      "--tflops", "1", "--net-gbps", "10", "--mac-tok-s", "400"]  # fmt: skip


def kv_wire_bytes(
    spec: ModelSpec, tokens: int, kv_format: TokenBytes | None = None, itemsize: int | None = None
) -> int:
    """K and V bytes of a `tokens`-position prompt on the wire (see `kv_bytes`)."""
    return kv_bytes(spec, kv_format, itemsize).at(tokens)


def gemma_270m_spec(dtype: str = "bfloat16") -> ModelSpec:
    kinds = tuple(FULL if i in GLOBAL else LayerKind("sliding", WINDOW) for i in range(LAYERS))
    return ModelSpec(
        path=Path("gemma-3-270m"), name="gemma-3-270m", family="gemma3_text", num_layers=LAYERS,
        hidden_size=640, num_heads=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=2048, vocab_size=262144, rms_norm_eps=1e-6, rope_theta=1e6,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        max_position_embeddings=32768, torch_dtype=dtype, eos_token_ids=(1,), bos_token_id=2,
        layer_kinds=kinds,
    )  # fmt: skip


def test_sliding_layers_send_their_window_and_full_layers_every_position() -> None:
    spec = gemma_270m_spec()
    per_layer = 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: 1 KiB per position
    kv = kv_bytes(spec)
    assert kv.full_per_token == 3 * per_layer
    assert kv.window_bytes == 15 * WINDOW * per_layer
    assert kv.sliding_layers == 15 and kv.layers == LAYERS
    # by hand at 2048 tokens: 3 layers × 2048 positions + 15 × 512, against 18 × 2048
    assert kv.at(2048) == (3 * 2048 + 15 * 512) * per_layer
    all_full = kv_wire_bytes(replace(spec, layer_kinds=()), 2048)
    assert all_full == LAYERS * 2048 * per_layer == 2048 * spec.kv_bytes_per_token
    assert kv.at(2048) / all_full == pytest.approx(0.375)
    # inside the window every layer sends every position
    assert kv.at(300) == 300 * spec.kv_bytes_per_token
    assert [kv.layer(i, 2048) for i in (4, 5)] == [WINDOW * per_layer, 2048 * per_layer]


def test_quantized_kv_packs_the_full_layers_and_leaves_the_windows_in_float() -> None:
    spec, q8 = gemma_270m_spec(), KVFormat(8)
    kv = kv_bytes(spec, q8)
    assert kv.full_per_token == q8.bytes_per_token(3, KV_HEADS, HEAD_DIM, 2)
    assert kv.window_bytes == kv_bytes(spec).window_bytes
    dense = replace(spec, layer_kinds=())  # every layer full: the old count, to the byte
    assert kv_wire_bytes(dense, 100, q8) == 100 * q8.bytes_per_token(LAYERS, 1, HEAD_DIM, 2)
    assert kv_wire_bytes(gemma_270m_spec("float32"), 1) == 2 * kv_wire_bytes(spec, 1)


def test_the_router_counts_the_window_bytes() -> None:
    """On a slow link the transfer decides: an all-full count keeps a long prompt here, the
    windowed one (0.375 of it at 2048 tokens) sends it to the GPU."""
    spec = gemma_270m_spec()
    gpu = Peer(address="http://gpu", trusted=True, roles=("prefill",), prefill_tok_s=20000.0,
               link_Bps=10e6)  # fmt: skip
    mac = LocalRate(tok_s=1000.0)  # 2.05 s at 2048 tokens
    windowed = choose("auto", 2048, kv_bytes(spec), mac, [gpu])
    all_full = choose("auto", 2048, kv_bytes(replace(spec, layer_kinds=())), mac, [gpu])
    assert windowed.where == "remote" and all_full.where == "local"
    assert windowed.remote_s is not None and all_full.remote_s is not None
    assert windowed.remote_s < 2048 / 1000.0 < all_full.remote_s


def test_plan_shows_full_and_window_bytes_apart(
    tiny_model: MakeTiny, capsys: pytest.CaptureFixture[str]
) -> None:
    """A made gemma3 model with Gemma-3-270M's attention shape (narrow elsewhere)."""
    model = tiny_model(
        arch="gemma3", layers=LAYERS, hidden=64, heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate=128, vocab=512, dtype="bfloat16", sliding_window=WINDOW,
        sliding_window_pattern=PATTERN,
    )  # fmt: skip
    assert main(["plan", "--model", str(model), "--tokens", "2048", *HW, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    per_layer = 2 * KV_HEADS * HEAD_DIM * 2
    m = r["model"]
    assert (m["kv_bytes_per_token"], m["sliding_layers"], m["windows"]) == (
        3 * per_layer,
        15,
        [WINDOW],
    )
    assert m["kv_window_bytes"] == 15 * WINDOW * per_layer
    wire = {w["bits"]: w for w in r["kv_wire"]}
    assert wire[16]["bytes"] == (3 * 2048 + 15 * 512) * per_layer
    assert wire[16]["all_full_bytes"] == 18 * 2048 * per_layer
    assert wire[16]["transfer_s"] == pytest.approx(wire[16]["bytes"] / r["hardware"]["net_Bps"])
    assert wire[8]["window_bytes"] == m["kv_window_bytes"]  # windows stay in bf16
    assert main(["plan", "--model", str(model), "--tokens", "2048", *HW]) == 0
    out = capsys.readouterr().out
    assert "full layers (3) 3.0 KiB/token, sliding layers (15, window 512) at most 7.5 MiB" in out
    assert "0.375 of what all-full layers would send at 16 bits" in out
