"""`tandem prefill` (DESIGN.md "CLI"): an mlx-lm prompt cache out, the stats JSON, one-line
errors on bad input, and a bounded memory footprint on a model eight times the budget."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.planning.plan import make_plan

from tests.conftest import MakeTiny

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"arch": "llama", "layers": 8, "shards": 2, "rope_scaling": "llama3"}
STATS_KEYS = {
    "tokens", "layers", "wall_s", "load_busy_s", "compute_busy_s", "budget_bytes",
    "peak_weight_bytes", "peak_activation_bytes", "bytes_streamed", "resident_layers",
}  # fmt: skip


def tandem(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.app", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def model_dir(tiny_model: MakeTiny) -> Path:
    return tiny_model(**MODEL)


def test_prefill_writes_an_mlx_lm_prompt_cache(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

    n = 150
    tokens = np.random.default_rng(5).integers(0, 512, n).tolist()
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    index = load_index(model_dir)
    budget = sum(index.layer_bytes(i) for i in range(8)) // 4
    out, stats_file = tmp_path / "cache.safetensors", tmp_path / "stats.json"
    result = tandem(
        "prefill", "--model", model_dir, "--tokens-file", tmp_path / "tokens.json",
        "--out", out, "--budget", budget, "--chunk-tokens", 32, "--device", "cpu",
        "--stats-json", stats_file,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "cache.safetensors.partial").exists()

    cache = load_prompt_cache(str(out))
    model, _ = mlx_lm.load(str(model_dir))
    ref = make_prompt_cache(model)
    model(mx.array([tokens]), cache=ref)
    assert len(cache) == len(ref) == 8
    for ours, theirs in zip(cache, ref, strict=True):
        assert ours.offset == n
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert a.shape == (1, 2, n, 16)  # exact, not rounded up to mlx's 256 steps
            np.testing.assert_allclose(np.array(a), np.array(b[..., :n, :]), rtol=0, atol=1e-4)

    stats = json.loads(stats_file.read_text())
    assert set(stats) >= STATS_KEYS
    plan = make_plan(index, budget, direct=True)
    assert stats["tokens"] == n and stats["layers"] == 8
    assert stats["budget_bytes"] == budget
    assert stats["peak_weight_bytes"] == plan.pool_bytes <= budget
    assert stats["resident_layers"] == list(plan.resident_layers) != []
    assert stats["bytes_streamed"] == sum(index.layer_bytes(i) for i in range(8))
    assert stats["wall_s"] > 0 and stats["compute_busy_s"] > 0 and stats["load_busy_s"] > 0
    assert stats["peak_activation_bytes"] > 0


def _gpt2(model_dir: Path, tmp: Path) -> Path:
    copy = Path(shutil.copytree(model_dir, tmp / "gpt2"))
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    (copy / "config.json").write_text(json.dumps(config))
    return copy


# name → (tokens file text, extra arguments, how to get the model dir)
BAD_INPUTS: dict[str, tuple[str, list[str], Callable[[Path, Path], Path]]] = {
    "token_outside_vocab": ("[1, 2, 512]", [], lambda d, t: d),
    "empty_list": ("[]", [], lambda d, t: d),
    "not_json": ("1, 2, 3 (not JSON", [], lambda d, t: d),
    "budget_below_largest_tensor": ("[1, 2, 3]", ["--budget", "1000"], lambda d, t: d),
    "unsupported_family": ("[1, 2, 3]", [], _gpt2),
}


@pytest.fixture(scope="module")
def bad_runs(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Every bad input run at once (each process pays for importing torch)."""
    procs = {}
    for name, (text, extra, model) in BAD_INPUTS.items():
        tmp = tmp_path_factory.mktemp(name)
        (tmp / "tokens.json").write_text(text)
        out = tmp / "cache.safetensors"
        args = [
            sys.executable, "-m", "tandem.app", "prefill", "--model", str(model(model_dir, tmp)),
            "--tokens-file", str(tmp / "tokens.json"), "--out", str(out), "--device", "cpu",
            *extra,
        ]  # fmt: skip
        proc = subprocess.Popen(
            args, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        procs[name] = (proc, args, out)
    runs = {}
    for name, (proc, args, out) in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        runs[name] = (subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), out)
    return runs


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_one_line(
    case: str, bad_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path]]
) -> None:
    result, out = bad_runs[case]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tandem prefill: ")
    assert not out.exists()
    assert not out.with_name(out.name + ".partial").exists()


@pytest.mark.slow
def test_memory_stays_near_the_budget(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """A ~200 MB model through a 25 MB budget: the process grows by far less than the model."""
    model_dir = tiny_model(
        arch="llama", layers=16, hidden=512, heads=8, kv_heads=2, intermediate=1536, vocab=1024
    )
    index = load_index(model_dir)
    model_bytes = index.total_bytes
    assert 180e6 < model_bytes < 220e6
    budget = 25_000_000
    # ru_maxrss survives fork + exec on Linux, so a child of this (large) pytest process would
    # start with pytest's peak: read the peak of the child's own memory map (VmHWM) instead,
    # reset to the current RSS just before the prefill where the kernel allows it.
    script = textwrap.dedent(
        f"""
        import json, os, resource
        import numpy as np
        from tandem.nodes.prefill.engine import PrefillEngine

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

        engine = PrefillEngine({str(model_dir)!r}, budget={budget}, device="cpu")
        tokens = np.random.default_rng(0).integers(0, 1024, 300).tolist()
        before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS to the current RSS
        except OSError:
            pass
        kv = [(layer.k, layer.v) for layer in engine.prefill(tokens)]
        peak = status("VmHWM")
        stats = engine.last_stats
        print(json.dumps({{"growth": peak - before, "layers": len(kv),
                          "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "peak_weight_bytes": stats.peak_weight_bytes,
                          "bytes_streamed": stats.bytes_streamed}}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["layers"] == 16
    assert got["peak_weight_bytes"] <= budget
    assert got["bytes_streamed"] == sum(index.layer_bytes(i) for i in range(16))
    assert got["growth"] < 100e6, f"RSS grew by {got['growth'] / 1e6:.0f} MB"
