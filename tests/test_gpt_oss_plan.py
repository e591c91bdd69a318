"""`tandem plan` for gpt-oss-120b from its config.json alone (OpenAI's checkpoint: MXFP4 experts,
the rest bf16), on a 24 GB card with 128 GB of RAM and on an 8 GB card: the checkpoint's size,
the tiers, the routed share at 8/512/4096 tokens, the wire bytes (half the layers send at most
their window of 128, and in float only: the sinks)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tandem.nodes.model.shapes_index import shapes_index

from tests.test_plan_cmd import plan_json

CONFIG = Path(__file__).parent / "configs" / "gpt-oss-120b.json"
GIB = 1 << 30


@pytest.fixture(scope="module")
def g120(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpt-oss-120b")
    shutil.copy(CONFIG, out / "config.json")
    return out


def test_the_config_alone_describes_the_checkpoint(g120: Path) -> None:
    index = shapes_index(g120)
    assert 60.5 * GIB < index.total_bytes < 61 * GIB  # OpenAI's files: 65.3 GB
    layer = index.layers[0]
    assert layer["mlp.experts.gate_up_proj.weight"].dtype == "U32"  # MXFP4 words
    assert layer["mlp.experts.gate_up_proj.scales"].dtype == "U8"  # e8m0
    assert "mlp.experts.gate_up_proj.biases" not in layer
    assert layer["self_attn.q_proj.weight"].dtype == "BF16"  # modules_to_not_convert
    assert layer["mlp.router.weight"].dtype == "BF16"


@pytest.mark.parametrize(("budget", "pcie"), [("22GiB", "200"), ("7GiB", "128")])
def test_plan_on_a_24_and_an_8_gb_card(
    g120: Path, budget: str, pcie: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = plan_json(
        capsys, "--model", g120, "--device", "cuda", "--budget", budget,
        "--host-budget", "120GiB", "--pcie-gbps", pcie, "--disk-gbps", "50", "--tflops", "100",
        "--mac-tok-s", "400", "--tokens", "4096", "--table", "8,512,4096",
    )  # fmt: skip
    streamed = {row["tokens"]: row["bytes_streamed"] for row in plan["table"]}
    assert streamed[8] < 0.35 * streamed[512]  # 8 tokens choose ~22% of the experts
    assert streamed[512] == streamed[4096]  # every expert chosen
    tiers = plan["tiers"]
    assert tiers["disk_bytes"] == 0 and tiers["ram_bytes"] > 50 * GIB  # the RAM holds the rest
    (wire,) = plan["kv_wire"]  # 16 bits only: mlx-lm attends with sinks over a float cache
    assert wire["window_bytes"] == 18 * 2 * 8 * 64 * 2 * 128  # 18 sliding layers, 128 positions
    assert wire["bytes"] < 0.52 * wire["all_full_bytes"]
