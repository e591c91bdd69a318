"""Issue 37: a Qwen3.5 linear layer sends its state (conv and recurrent), the same bytes for
any prompt, and no K/V; `tandem plan` shows it apart from the full layers' K/V per token, and
the decode node's router counts it when it weighs remote against local prefill."""

from __future__ import annotations

import json

import pytest
from tandem.app.cli.main import main
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.decode.router import LocalRate, choose
from tandem.nodes.model import load_index
from tandem.nodes.model.kv_bytes import KVBytes, kv_bytes

from tests.conftest import MakeTiny
from tests.test_window_bytes import HW

# full attention every 4th layer of 8; linear: 4 key heads and 8 value heads of 64, conv 4
SHAPE = {"arch": "qwen3_5", "layers": 8, "hidden": 64, "heads": 4, "kv_heads": 1,
         "head_dim": 64, "linear_k_heads": 4, "linear_v_heads": 8, "linear_k_dim": 64,
         "linear_v_dim": 64, "conv_kernel": 4, "full_attention_interval": 4}  # fmt: skip
FULL_TOKEN = 2 * 1 * 64 * 4  # K and V of one position, one full layer, f32: 512 B
CONV_DIM = 2 * 4 * 64 + 8 * 64  # q, k and v channels through the conv: 1024
STATE = 4 * 3 * CONV_DIM + 4 * 8 * 64 * 64  # conv [1, 3, 1024] f32 + recurrent [1, 8, 64, 64]


def test_a_linear_layer_sends_its_state_whatever_the_prompt(tiny_model: MakeTiny) -> None:
    kv = kv_bytes(load_index(tiny_model(**SHAPE)).spec)
    assert kv.full_per_token == 2 * FULL_TOKEN and kv.state_bytes == 6 * STATE == 860160
    assert kv.fixed == (STATE, STATE, STATE, 0) * 2 and kv.sliding_layers == 0
    assert kv.at(1) == 2 * FULL_TOKEN + 6 * STATE
    assert kv.at(2048) - kv.at(1024) == 1024 * 2 * FULL_TOKEN  # only the full layers grow
    assert [kv.layer(i, 2048) for i in (2, 3)] == [STATE, 2048 * FULL_TOKEN]


def test_plan_shows_the_state_apart_from_the_full_layers_kv(
    tiny_model: MakeTiny, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model(**SHAPE)
    assert main(["plan", "--model", str(model), "--tokens", "2048", *HW, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    m = r["model"]
    assert (m["linear_layers"], m["sliding_layers"]) == (6, 0)
    assert (m["kv_bytes_per_token"], m["kv_state_bytes"]) == (2 * FULL_TOKEN, 6 * STATE)
    wire = {w["bits"]: w for w in r["kv_wire"]}
    assert wire[16]["bytes"] == 2048 * 2 * FULL_TOKEN + 6 * STATE
    assert wire[16]["all_full_bytes"] == 8 * 2048 * FULL_TOKEN
    assert wire[8]["state_bytes"] == wire[16]["state_bytes"] == 6 * STATE  # never quantized
    assert wire[8]["bytes"] - wire[8]["state_bytes"] < 2048 * 2 * FULL_TOKEN / 3
    assert main(["plan", "--model", str(model), "--tokens", "2048", *HW]) == 0
    out = capsys.readouterr().out
    assert "full layers (2) 1.0 KiB/token, linear layers (6) state 840.0 KiB whatever" in out
    assert "sliding" not in out
    assert "0.353 of what all-full layers would send at 16 bits" in out  # 2.8 of 8 MiB


def test_the_router_counts_the_state(tiny_model: MakeTiny) -> None:
    """A short prompt on a slow link: its K/V alone would go to the GPU, but the state (840
    KiB, 86 ms at 10 MB/s) costs more than the Mac's own 64 ms prefill."""
    kv = kv_bytes(load_index(tiny_model(**SHAPE)).spec)
    gpu = Peer(address="http://gpu", trusted=True, roles=("prefill",), prefill_tok_s=20000.0,
               link_Bps=10e6)  # fmt: skip
    mac = LocalRate(tok_s=1000.0)
    counted = choose("auto", 64, kv, mac, [gpu])
    kv_only = choose("auto", 64, KVBytes(kv.per_token, kv.windows), mac, [gpu])
    assert counted.where == "local" and kv_only.where == "remote"
    assert counted.remote_s is not None and counted.remote_s > 6 * STATE / 10e6
