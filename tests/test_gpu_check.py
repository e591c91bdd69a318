"""scripts/gpu-check, kept from rotting: its CPU smoke run (every section that can run on a CPU,
tiny) and its quick exit where there is no CUDA. The real run is on a GPU box (issue 17)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"
SECTIONS = {
    "env", "h2d", "attention", "kv", "requests", "quantized", "race", "sanitizer", "model",
    "memory", "small_card", "bench", "cuda_tests", "families", "dequant",
    "host", "ranks",
}  # fmt: skip
NO_CUDA = {"h2d", "sanitizer", "cuda_tests"}  # their plumbing runs on a CPU where it can
NEEDS_CUDA = {"race", "ranks"}  # not even started on a CPU
pytestmark = pytest.mark.timeout(200)  # the smoke run is one subprocess of up to 150 s


def _gpu_check(*args: str, out: Path, timeout: float) -> tuple[int, dict[str, Any], float]:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OUT": str(out)},
        check=False,
    )
    assert done.stdout.strip(), done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout), time.monotonic() - t0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("out")
    work = tmp_path_factory.mktemp("work")
    rc, report, _ = _gpu_check("--cpu-smoke", "--work-dir", str(work), out=out, timeout=150)
    assert json.loads((out / "gpu-check.json").read_text()) == report
    assert list(work.iterdir()) == []  # its models are cleaned up
    report["rc"] = rc
    return report


@pytest.mark.slow
def test_smoke_runs_every_section(smoke: dict[str, Any]) -> None:
    sections = smoke["sections"]
    assert set(sections) == SECTIONS
    for name, section in sections.items():
        if name in NO_CUDA:
            assert section["ok"] is None and section["skipped"] == "no cuda", (name, section)
        elif name in NEEDS_CUDA:
            assert section == {"ok": None, "skipped": "needs CUDA"}, (name, section)
        else:
            assert section["ok"] is True, (name, section)
    assert smoke["summary"]["failed"] == [] and smoke["rc"] == 0
    assert smoke["smoke"] is True and smoke["wall_s"] < smoke["time_limit_s"]
    # the sections the box cannot run here still ran their plumbing
    assert sections["sanitizer"]["requests_ok"] is True
    assert (
        sections["cuda_tests"]["tests_ran"] is True
        and "skipped" in sections["cuda_tests"]["summary"]
    )


@pytest.mark.slow
def test_smoke_kv_agrees_at_every_granularity(smoke: dict[str, Any]) -> None:
    kv = smoke["sections"]["kv"]
    assert kv["devices"] == "cpu vs cpu"
    for dtype in ("float32", "bfloat16"):
        checked = {g: e for g, e in kv[dtype].items() if e.get("ok") is not None}
        assert "resident" in checked and checked.keys() & {"layer", "part", "slice"}, kv[dtype]
        for granularity, entry in checked.items():
            assert entry["ok"] and entry["granularity"] == granularity
            assert entry["prefix"]["ok"] and entry["vs_reference"]["layers"] == 8
            if dtype == "float32":  # granularities and the prefix path compute the same K/V
                assert entry["vs_reference"]["max_abs"] <= 1e-4
                assert entry["prefix"]["max_abs"] <= 1e-4
        for entry in kv[dtype].values():
            assert entry.get("ok") is not None or entry["skipped"].startswith("no budget")


@pytest.mark.slow
def test_smoke_requests_attention_memory_bench(smoke: dict[str, Any]) -> None:
    s = smoke["sections"]
    streamed = s["requests"]["streamed_budget"]
    assert streamed["plan"]["granularity"] != "resident" and streamed["second_streams_less"]
    assert streamed["after_cancel_vs_first"]["max_abs"] == 0.0
    assert s["requests"]["default_budget"]["second"]["bytes_streamed"] == 0
    for dtype in ("bfloat16", "float32"):
        for case in ("start_0", "start_gt_0"):
            assert s["attention"][dtype][case]["backend"] != "unknown"
            assert s["attention"][dtype][case]["backends"]["MATH"]["ok"]
    memory = s["memory"]
    assert memory["model"]["layers"] == 2 and memory["max_prompt_tokens"] == 128
    for run in memory["runs"].values():  # the plan's own count, on a CPU: within its reserve
        assert run["ok"] and not run["oom"] and 0 < run["measured_over_reserve"] <= 1.0
    assert memory["runs"]["128"]["reserve_bytes"] == memory["reserve_bytes"] > 0
    assert s["small_card"]["plan"]["granularity"] != "resident" and not s["small_card"]["oom"]
    bench = s["bench"]
    assert bench["overlap_ratio"] > 0 and bench["balanced"]["link_gbps"] > 0  # throttled
    assert bench["unthrottled"]["link_gbps"] is None and bench["load_over_compute"] > 0
    assert bench["vs_resident_ratio"] > 0 and bench["ok"]
    ram, cold = bench["loader"]["ram"], bench["loader"]["cold"]  # a warm pass: all from RAM
    assert ram["disk_bytes"] == 0 and ram["ram_bytes"] == ram["bytes_streamed"] > 0
    assert cold["disk_bytes"] == cold["bytes_streamed"] > 0 and cold["ram_bytes"] == 0


@pytest.mark.slow
def test_smoke_quantized_model_and_wire_kv(smoke: dict[str, Any]) -> None:
    q = smoke["sections"]["quantized"]
    assert q["weights"]["bits"] == 4 and q["devices"] == "cpu vs cpu"
    for bits in (8, 4):  # streamed against all resident, on the CPU: the same values
        case = q[f"kv_bits_{bits}"]
        assert case["ok"] and case["kv"]["layers"] == 3 and case["kv"]["max_abs"] == 0.0
        assert case["wire"]["bits"] == bits and case["wire"]["values"] > 0
        assert case["wire"]["max_level_diff"] == 0 and case["wire"]["ok"]
        assert case["same_input"]["differ_share"] == 0.0 and case["same_input"]["ok"]


def test_without_cuda_it_says_so_quickly(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, report, seconds = _gpu_check(out=tmp_path, timeout=60)
    assert rc == 0 and report["cuda"] is False and list(report["sections"]) == ["env"]
    assert seconds < 30
    assert (tmp_path / "gpu-check.json").exists()


def _gpu_check_module(name: str) -> Any:
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(f"gpu_check.{name}")
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_the_4bit_model_is_mlx_s_layout(tmp_path: Path) -> None:
    """quantize_model's words, scales and biases are what mx.dequantize reads back."""
    mx = pytest.importorskip("mlx.core")
    np = pytest.importorskip("numpy")
    from safetensors.numpy import load_file
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    quantized = _gpu_check_module("quantized")
    shape = {"layers": 1, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256}
    src = make_model(tmp_path / "f", MakeModelArgs(**shape, vocab=384), with_tokenizer=False)
    out = quantized.quantize_model(src, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4}
    floats = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    packed = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    name = "model.layers.0.mlp.down_proj"
    w = floats[f"{name}.weight"]  # [128, 256] float32
    words = packed[f"{name}.weight"]
    assert words.dtype == np.uint32 and words.shape == (128, 32)  # 256 values of 4 bits
    want = mx.quantize(mx.array(w), group_size=64, bits=4)  # (words, scales, biases)
    for k, expected in zip(("weight", "scales", "biases"), want, strict=True):
        np.testing.assert_array_equal(packed[f"{name}.{k}"], np.asarray(expected), err_msg=k)
    assert packed["model.layers.0.input_layernorm.weight"].dtype == w.dtype  # norms stay float


def test_the_balanced_prompt_makes_compute_outlast_loading() -> None:
    overlap = _gpu_check_module("overlap")
    free = {"load_s": 1.0, "compute_s": 0.05}
    assert overlap.balanced_tokens(free, 4096, 512, 8192) == 8192  # capped at the longest
    free = {"load_s": 0.1, "compute_s": 0.06}
    assert overlap.balanced_tokens(free, 4096, 512, 8192) == 8192  # 4096 * 1.67 * 1.15: chunks
    assert overlap.balanced_tokens({"load_s": 0.05, "compute_s": 0.06}, 4096, 512, 8192) == 4096
    assert overlap.balanced_tokens({"ok": False}, 4096, 512, 8192) == 4096
