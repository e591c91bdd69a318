"""`tandem plan --devices 2` (issue 52): Llama-3-70B in bf16 from its config.json alone on two
24 GB cards with 120 GiB of RAM, x16/x16 and x8/x8: each rank holds half of every layer, twice
the resident layers between them, and where the link binds the pass takes half the time at
x16/x16, about one card's at x8/x8 (each card's link halved)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tandem.app.cli.main import main

from tests.test_plan_cmd import plan_json

CONFIG = Path(__file__).parent / "configs" / "llama-3-70b.json"
GIB = 1 << 30
CARD = ("--device", "cuda", "--budget", "22GiB", "--host-budget", "120GiB", "--pcie-gbps",
        "200", "--disk-gbps", "50", "--tflops", "150", "--mac-tok-s", "500",
        "--tokens", "4096")  # fmt: skip


@pytest.fixture(scope="module")
def l70(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama-3-70b")
    shutil.copy(CONFIG, out / "config.json")
    return out


@pytest.mark.parametrize(("lanes", "most"), [("16", 0.55), ("8", 1.05)])
def test_two_cards_each_stream_half_of_every_layer(
    l70: Path, lanes: str, most: float, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = plan_json(capsys, "--model", l70, *CARD, "--devices", "2", "--lanes", lanes)
    one = plan["plan"]
    ranks = plan["ranks"]
    assert ranks["devices"] == 2 and len(ranks["ranks"]) == 2
    whole = one["resident_bytes"] + one["bytes_per_pass"]  # the layers, on one card
    for rank in ranks["ranks"]:
        assert abs(rank["weight_bytes"] - whole / 2) < 0.01 * whole  # half of every layer
        assert rank["budget_bytes"] == 22 * GIB and rank["lanes"] == int(lanes)
        assert rank["copy_Bps"] == pytest.approx(25e9 * int(lanes) / 16)
        assert len(rank["resident_layers"]) > len(one["resident_layers"])  # half-layers
    # two per layer of [4096, 8192] bf16
    assert ranks["reduce_bytes_per_layer"] == 2 * 4096 * 8192 * 2
    assert plan["bound"] == "pcie"
    assert ranks["predicted_wall_s"] < most * plan["predicted_wall_s"]
    assert ranks["one_device_s"] == plan["predicted_wall_s"]


def test_one_device_has_no_ranks(l70: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_json(capsys, "--model", l70, *CARD)["ranks"] is None
    assert main(["plan", "--model", str(l70), *CARD, "--devices", "0"]) != 0
    assert "--devices must be positive" in capsys.readouterr().err
