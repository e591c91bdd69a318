"""`tandem plan` for GLM-4.5-Air from its config.json alone (zai-org's bf16 checkpoint, and
mlx-community's 4-bit conversion of it), on a 24 GB card with 64 GB of RAM: the checkpoint's
size (without its multi-token-prediction layer, which is never read), the tiers, the routed
share at 8/512/4096 tokens, the wire bytes. And the config-only index of a made GLM model
equals its real headers, float and 4-bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.model.shapes_index import shapes_index

from tests.conftest import MakeTiny
from tests.test_glm4_moe import glm4_args
from tests.test_plan_cmd import plan_json

CONFIG = Path(__file__).parent / "configs" / "glm-4.5-air.json"
GIB = 1 << 30
MLX_4BIT = {"quantization": {"group_size": 64, "bits": 4}}


@pytest.fixture(scope="module", params=["bf16", "4bit"])
def air(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"glm-4.5-air-{request.param}")
    shutil.copy(CONFIG, out / "config.json")
    if request.param == "4bit":
        config = json.loads(CONFIG.read_text())
        (out / "config.json").write_text(json.dumps({**config, **MLX_4BIT}))
    return out


def test_the_config_alone_describes_the_checkpoint(air: Path) -> None:
    index = shapes_index(air)
    quantized = index.quantized
    # zai-org's files: ≈ 221 GB with the MTP layer; mlx-community's 4-bit: ≈ 60 GB
    low, high = (55.5, 56.5) if quantized else (198.5, 199.5)
    assert low * GIB < index.total_bytes < high * GIB
    dense, routed = index.layers[0], index.layers[1]
    assert dense["mlp.gate_proj.weight"].shape[0] == 10944 and "mlp.gate.weight" not in dense
    assert routed["mlp.gate.weight"].dtype == "BF16"  # a bare weight in mlx-lm: never quantized
    assert routed["mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert routed["mlp.switch_mlp.gate_proj.weight"].dtype == ("U32" if quantized else "BF16")
    assert routed["mlp.shared_experts.down_proj.weight"].shape[-1] in (1408, 1408 * 4 // 32)
    assert routed["self_attn.q_proj.bias"].shape == (96 * 128,)


def test_plan_on_a_24_gb_card_with_64_gb_of_ram(
    air: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = plan_json(
        capsys, "--model", air, "--device", "cuda", "--budget", "22GiB", "--host-budget",
        "60GiB", "--pcie-gbps", "200", "--disk-gbps", "50", "--tflops", "100", "--mac-tok-s",
        "400", "--tokens", "4096", "--table", "8,512,4096",
    )  # fmt: skip
    streamed = {row["tokens"]: row["bytes_streamed"] for row in plan["table"]}
    assert streamed[8] < 0.5 * streamed[512]  # 8 tokens choose ~40% of the experts
    assert streamed[512] == streamed[4096]  # every expert chosen
    tiers = plan["tiers"]
    assert tiers["device_bytes"] > 8 * GIB  # a few whole layers resident
    if "quantization" in json.loads((air / "config.json").read_text()):
        assert tiers["disk_bytes"] == 0 and tiers["ram_bytes"] > 40 * GIB
    else:
        # 199 GiB: the RAM tier full (spread by bytes: plan._fill), the rest read each pass
        assert tiers["ram_bytes"] > 55 * GIB and tiers["disk_bytes"] > 120 * GIB
    wire = {w["bits"]: w for w in plan["kv_wire"]}
    assert wire[16]["bytes_per_token"] == 2 * 46 * 8 * 128 * 2  # every layer full attention


@pytest.mark.parametrize("layout", ["stacked", "stacked-4bit"])
def test_the_config_only_index_equals_the_made_headers(layout: str, tiny_model: MakeTiny) -> None:
    model = tiny_model(**glm4_args(layout))
    real, imagined = load_index(model), shapes_index(model)
    for i, (ours, theirs) in enumerate(zip(imagined.layers, real.layers, strict=True)):
        assert {k: (e.shape, e.dtype) for k, e in ours.items()} == {
            k: (e.shape, e.dtype) for k, e in theirs.items()
        }, i
    assert imagined.total_bytes == real.total_bytes
