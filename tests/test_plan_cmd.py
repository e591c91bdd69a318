"""`tandem plan` (issue 17): the prefill node's cost model as a command.

A Llama-3-70B directory of safetensors headers without data (the command reads only
headers); a short calibration; and the prediction against `tandem bench prefill` on this CPU.
The ring simulator and the break-even are in test_plan_ring.py.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from tandem.app.cli.main import main
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.measure.bench import bench, make_random_model
from tandem.nodes.prefill.planning import cost
from tandem.nodes.prefill.planning.budget import plan_for_prompts, prompt_activations
from tandem.nodes.prefill.planning.plan import make_plan

from tests.test_import_boundaries import loaded_after_import as _loaded_after_import

# Llama-3-70B: bf16, GQA 64/8, llama3 RoPE scaling
L70B = {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "inter": 28672,
        "vocab": 128256}  # fmt: skip
GIB = 2**30
QUANT_GROUP = 64
T = TypeVar("T")
HW_70B = ["--pcie-gbps", "200", "--tflops", "150", "--net-gbps", "10", "--mac-tok-s", "400",
          "--host-budget", "0"]  # fmt: skip


def _layer_shapes(i: int, h: int, nq: int, nkv: int, inter: int) -> dict[str, list[int]]:
    p, d = f"model.layers.{i}.", h // nq
    return {
        p + "input_layernorm.weight": [h],
        p + "post_attention_layernorm.weight": [h],
        p + "self_attn.q_proj.weight": [nq * d, h],
        p + "self_attn.k_proj.weight": [nkv * d, h],
        p + "self_attn.v_proj.weight": [nkv * d, h],
        p + "self_attn.o_proj.weight": [h, nq * d],
        p + "mlp.gate_proj.weight": [inter, h],
        p + "mlp.up_proj.weight": [inter, h],
        p + "mlp.down_proj.weight": [h, inter],
    }


def _stored(name: str, shape: list[int], bits: int | None) -> dict[str, tuple[str, list[int]]]:
    """A tensor as safetensors stores it: bf16, or an MLX-quantized matrix's three parts."""
    if bits is None or len(shape) == 1:
        return {name: ("BF16", shape)}
    module, (rows, cols) = name.removesuffix(".weight"), shape
    groups = [rows, cols // QUANT_GROUP]
    return {name: ("U32", [rows, cols * bits // 32]), f"{module}.scales": ("BF16", groups),
            f"{module}.biases": ("BF16", groups)}  # fmt: skip


def write_headers_only(
    out: Path, shards: int = 8, kv_heads: int | None = None, bits: int | None = None
) -> Path:
    """A 70B model as safetensors headers (8-byte length + JSON) with no tensor data; with
    `bits`, MLX-quantized in groups of QUANT_GROUP; `kv_heads` other than Llama's 8."""
    m = {**L70B, "kv_heads": kv_heads or L70B["kv_heads"]}
    h = m["hidden"]
    tensors: list[dict[str, list[int]]] = [{} for _ in range(shards)]
    tensors[0]["model.embed_tokens.weight"] = [m["vocab"], h]
    for i in range(m["layers"]):
        shapes = _layer_shapes(i, h, m["heads"], m["kv_heads"], m["inter"])
        tensors[i * shards // m["layers"]].update(shapes)
    tensors[-1] |= {"model.norm.weight": [h], "lm_head.weight": [m["vocab"], h]}
    out.mkdir(parents=True)
    weight_map = {}
    for k, shard in enumerate(tensors):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt" if bits is None else "mlx"}}
        offset = 0
        for tensor, shape in shard.items():
            for stored, (dtype, dims) in _stored(tensor, shape, bits).items():
                nbytes = (4 if dtype == "U32" else 2) * math.prod(dims)
                header[stored] = {"dtype": dtype, "shape": dims,
                                  "data_offsets": [offset, offset + nbytes]}  # fmt: skip
                offset += nbytes
                weight_map[stored] = name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (out / name).write_bytes(struct.pack("<Q", len(raw)) + raw)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": m["inter"], "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"], "num_key_value_heads": m["kv_heads"],
        "head_dim": h // m["heads"], "rms_norm_eps": 1e-5, "vocab_size": m["vocab"],
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_parameters": {**scaling, "rope_theta": 500000.0}, "rope_scaling": scaling,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
        "eos_token_id": 128001,
    }  # fmt: skip
    if bits is not None:
        config["quantization"] = {"group_size": QUANT_GROUP, "bits": bits, "mode": "affine"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def l70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_headers_only(tmp_path_factory.mktemp("plan") / "llama-3-70b")


@pytest.mark.parametrize(("kv_heads", "bits", "budgets_mib"),
                         [(8, None, (2048, 6144, 24576)), (8, 4, (113, 300, 3072)),
                          (1, 4, (180, 360))])  # fmt: skip
def test_70b_shapes_plan_quickly_down_to_small_budgets(
    kv_heads: int, bits: int | None, budgets_mib: tuple[int, ...], tmp_path: Path
) -> None:
    """A hang guard, not a benchmark: cutting a 70B layer's 28672 MLP rows must not try
    range counts one by one (with one KV head, or 4 bits, a plan took minutes). Each plan
    here takes well under a second; the bound only catches a search gone quadratic."""
    index = load_index(write_headers_only(tmp_path / "m", kv_heads=kv_heads, bits=bits),
                       require_data=False)  # fmt: skip
    for mib in budgets_mib:
        t0 = time.perf_counter()
        plan = make_plan(index, mib << 20, direct=True)
        assert time.perf_counter() - t0 < 10, f"{mib} MiB"
        assert plan.device_bytes <= mib << 20
        assert all(ld.nbytes <= plan.slot_bytes for ld in plan.loads if not ld.resident)


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> dict:
    assert main(["plan", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_70b_headers_only_is_refused_by_default_but_planned(l70b: Path) -> None:
    assert sum(f.stat().st_size for f in l70b.iterdir()) < 1 << 20  # no tensor data at all
    with pytest.raises(ModelError, match="runs past the end"):
        load_index(l70b)
    index = load_index(l70b, require_data=False)
    assert index.total_bytes > 140e9 and index.dtype == "BF16"


@pytest.mark.parametrize(("disk_gbps", "bound"), [("50", "disk"), ("400", "pcie")])
def test_70b_plan_and_prediction(
    l70b: Path, capsys: pytest.CaptureFixture[str], disk_gbps: str, bound: str
) -> None:
    r = plan_json(capsys, "--model", l70b, "--budget", "24GiB", "--tokens", "4096",
                  "--device", "cuda", "--disk-gbps", disk_gbps, *HW_70B)  # fmt: skip
    plan, hw, model = r["plan"], r["hardware"], r["model"]
    assert r["budget_bytes"] == 24 * GIB
    assert plan["pool_bytes"] + plan["activation_reserve_bytes"] <= 24 * GIB
    assert plan["granularity"] in ("layer", "part", "slice") and plan["n_slots"] >= 2
    assert plan["resident_layers"] and plan["resident_bytes"] > 10 * GIB
    # as a CUDA node by default: activations of an 8k prompt kept free; 16k is refused
    assert plan["max_prompt_tokens"] == 8192 and GIB < plan["activation_reserve_bytes"] < 4 * GIB
    assert [row["fits"] for row in r["table"]] == [True, True, False] and r["fits"]
    # every decoder-layer byte not resident streams once per pass
    resident = sum(model["layer_bytes"] // 80 for _ in plan["resident_layers"])
    assert plan["bytes_per_pass"] == model["layer_bytes"] - resident
    assert plan["bytes_per_pass"] == pytest.approx(model["bytes"] - resident, rel=0.05)
    assert hw["copy_Bps"] == 25e9 and hw["disk_Bps"] == float(disk_gbps) * 1e9 / 8
    assert r["source"]["flops"] == "given"
    # bound by the slower of disk and PCIe, and close to that floor
    assert r["bound"] == bound
    floor = plan["bytes_per_pass"] / min(hw["copy_Bps"], hw["disk_Bps"])
    assert floor <= r["predicted_wall_s"] <= 1.15 * floor
    assert r["compute_s"] < r["predicted_wall_s"]
    table = r["table"]
    assert [row["tokens"] for row in table] == [1024, 4096, 16384]
    walls = [row["predicted_wall_s"] for row in table]
    assert walls == sorted(walls) and walls[1] == pytest.approx(r["predicted_wall_s"])
    rates = [row["tokens_per_s"] for row in table]
    assert rates == sorted(rates)
    # remote prefill pays once the Mac's own 400 tok/s takes longer than one pass here
    n = r["break_even_tokens"]
    assert isinstance(n, int) and 0 < n <= r["break_even_limit"]
    assert n == pytest.approx(400 * r["predicted_wall_s"], rel=0.1)
    for row in table:
        assert (row["remote_s"] < row["local_s"]) == (row["tokens"] >= n)


def test_70b_human_table(l70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", str(l70b), "--budget", "24GiB", "--device", "cuda",
            "--disk-gbps", "50", *HW_70B]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layer granularity" in out and "disk-bound" in out
    assert "faster than the Mac from" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("16384")]) == 1


def test_errors_are_one_line_exit_2(l70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--model", str(l70b.parent / "missing"), "--budget", "1GiB"], "no such model directory"),
        (["--model", str(l70b), "--budget", "24 gigs"], "--budget: not a size"),
        (["--model", str(l70b), "--budget", "1MiB", "--device", "cuda", *HW_70B,
          "--disk-gbps", "50"], "leaves nothing for weights"),
        (["--model", str(l70b), "--budget", "1MiB", "--device", "cpu", *HW_70B,
          "--disk-gbps", "50"], "smaller than the largest tensor"),
        (["--model", str(l70b), "--budget", "1GiB", "--tflops", "-1"], "--tflops must be"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(["plan", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tandem plan: ") and message in err and "\n" not in err


def test_cuda_without_a_gpu_needs_budget_and_rates(
    l70b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the budget and rates come from it")
    assert main(["plan", "--model", str(l70b), "--device", "cuda", *HW_70B]) == 2
    assert "give --budget" in capsys.readouterr().err
    assert main(["plan", "--model", str(l70b), "--device", "cuda", "--budget", "24GiB"]) == 2
    assert "give --pcie-gbps and --tflops" in capsys.readouterr().err


def test_plan_command_keeps_torch_out_until_it_runs() -> None:
    assert "torch" not in _loaded_after_import("tandem.app.cli.plan_cmd")


# --- this machine --------------------------------------------------------------------------


def test_calibration_is_quick_and_cleans_up(tmp_path: Path, tiny_model) -> None:
    spec = load_index(tiny_model(arch="llama", layers=2)).spec
    t0 = time.perf_counter()
    hw = cost.calibrate("cpu", "F32", spec, net_Bps=1e9, mac_tok_s=100, directory=tmp_path,
                        disk_bytes=16 << 20, copy_bytes=16 << 20, seconds=0.05)  # fmt: skip
    assert time.perf_counter() - t0 < 10
    rates = [hw.copy_Bps, hw.disk_Bps, hw.flops, hw.attn_flops, hw.elementwise_Bps, hw.overhead]
    assert all(r is not None and 0 < r < math.inf for r in rates)
    assert list(tmp_path.iterdir()) == []  # the disk probe is gone


def _busy_ticks() -> tuple[int, int]:
    """(CPU ticks all processes spent busy, ticks this process spent), from /proc."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return sum(ticks) - ticks[3] - ticks[4], int(mine[11]) + int(mine[12])  # less idle, iowait


def others_cores(fn: Callable[[], T]) -> tuple[T, float]:
    """`fn()` and the cores other processes kept busy meanwhile (the box is shared)."""
    (all0, mine0), t0 = _busy_ticks(), time.perf_counter()
    value = fn()
    (all1, mine1), t1 = _busy_ticks(), time.perf_counter()
    return value, ((all1 - all0) - (mine1 - mine0)) / os.sysconf("SC_CLK_TCK") / (t1 - t0)


@pytest.mark.slow
@pytest.mark.serial
def test_prediction_tracks_the_bench_on_this_cpu(tmp_path: Path) -> None:
    """Predicted vs measured wall for three budgets (all resident, ½ and ¼ of the layers),
    within a loose 35% (the 15% claim is measured by a script on a quiet machine). Up to
    three tries in about 40 s: a systematic error fails every quiet one; a try during which
    other processes kept a core busy proves nothing, and if every try was one, it skips."""
    if not Path("/proc/stat").exists():
        pytest.skip("needs /proc to tell a quiet machine from a busy one")
    model = make_random_model("16x384", tmp_path / "m", "float32")
    index = load_index(model)
    layers = sum(index.layer_bytes(i) for i in range(index.spec.num_layers))
    slack = 1 << 20  # for O_DIRECT alignment: whole layers stream (slices read row by row)
    budgets = [index.total_bytes + slack, layers // 2 + slack, layers // 4 + slack]
    plans = [cost.node_plan(index, b) for b in budgets]
    assert [p.granularity for p in plans] == ["resident", "layer", "layer"]
    quiet: list[list[float]] = []
    deadline = time.perf_counter() + 40
    for _ in range(3):
        if time.perf_counter() > deadline:
            break
        hw, busy = others_cores(lambda: cost.calibrate(
            "cpu", index.dtype, index.spec, net_Bps=1e9, mac_tok_s=100, directory=tmp_path,
            disk_bytes=64 << 20, seconds=0.3))  # fmt: skip
        errors = []
        for budget, plan in zip(budgets, plans, strict=True):
            predicted = cost.predict(plan, index, 1024, hw).wall_s
            measured, noise = others_cores(
                lambda b=budget: bench(model, 1024, b, device="cpu", repeat=3, host_budget=0)[
                    "wall_s"
                ]
            )
            busy = max(busy, noise)
            errors.append(predicted / measured - 1)
        if busy > 0.25:
            continue
        if all(abs(e) < 0.35 for e in errors):
            return
        quiet.append(errors)
    if not quiet:
        pytest.skip("other processes kept a core busy through every try: no timing")
    pytest.fail(f"prediction off by more than 35% in every quiet try: {quiet}")


def test_the_kv_on_the_wire_at_16_8_and_4_bits(
    l70b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 20: the plan shows the prompt's KV transfer in each format the router counts."""
    r = plan_json(capsys, "--model", l70b, "--budget", "24GiB", "--tokens", "8192",
                  "--device", "cuda", "--disk-gbps", "50", *HW_70B)  # fmt: skip
    wire = {w["bits"]: w for w in r["kv_wire"]}
    assert wire[16]["bytes_per_token"] == 327_680  # 80 layers × 8 KV heads × 128 × bf16 × K,V
    assert wire[8]["bytes_per_token"] / wire[16]["bytes_per_token"] == pytest.approx(0.53125)
    assert wire[4]["bytes_per_token"] / wire[16]["bytes_per_token"] == pytest.approx(0.28125)
    net = r["hardware"]["net_Bps"]
    assert wire[16]["transfer_s"] == pytest.approx(8192 * 327_680 / net)
    argv = ["plan", "--model", str(l70b), "--budget", "24GiB", "--device", "cuda",
            "--disk-gbps", "50", *HW_70B]  # fmt: skip
    assert main(argv) == 0
    assert "KV wire" in capsys.readouterr().out


def test_an_8gb_card_cut_plan_runs_near_the_pcie_floor(
    l70b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 17 item 7: on a small card a 70B layer is cut into near-equal loads with several
    in flight, so a pass at 4k tokens stays close to bytes / PCIe (the two-slot part plan was
    modelled at 7.8 s against a 5.4 s floor)."""
    r = plan_json(capsys, "--model", l70b, "--budget", "6GiB", "--tokens", "4096",
                  "--device", "cuda", "--disk-gbps", "400", *HW_70B)  # fmt: skip
    plan = r["plan"]
    assert plan["granularity"] == "slice" and plan["n_slots"] >= 4
    floor = plan["bytes_per_pass"] / r["hardware"]["copy_Bps"]
    assert r["predicted_wall_s"] <= 1.10 * floor


def test_70b_reserves_a_cut_ops_output_only_on_a_budget_that_cuts(l70b: Path) -> None:
    """On a 24 GiB card a 70B layer streams whole: the 8k prompt's reserve holds no
    [8192, 28672] kept output (560 MiB with the CUDA slack), which goes to the weights; on
    6 GiB the ops are cut, and the reserve holds it."""
    index = load_index(l70b, require_data=False)
    whole = prompt_activations(index.spec, 8192, 0, 512, 2, "cuda", cut_ops=False)
    cut = prompt_activations(index.spec, 8192, 0, 512, 2, "cuda", cut_ops=True)
    assert cut - whole > 500 * 2**20
    roomy, tight = (plan_for_prompts(index, n * GIB, 8192, "cuda") for n in (24, 6))
    assert not roomy.cuts_ops and roomy.reserve_bytes == whole
    assert roomy.device_bytes + whole <= 24 * GIB
    assert tight.cuts_ops and tight.reserve_bytes == cut
    assert tight.device_bytes + cut <= 6 * GIB


def test_plan_says_what_a_pass_of_n_prompts_costs(
    tiny_model, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 46: a pass serving N prompts streams the weights once: where the link binds it
    costs about one lone pass, not N; where compute binds, about N."""
    model = tiny_model(arch="llama", layers=8)
    budget = sum(load_index(model).layer_bytes(i) for i in range(8)) // 4
    rates = ["--device", "cpu", "--disk-gbps", "100", "--budget", str(budget)]
    slow_link = plan_json(capsys, "--model", model, "--tokens", "64", "--pcie-gbps",
                          "0.01", "--tflops", "100", "--batch", "3", *rates)  # fmt: skip
    b = slow_link["batch"]
    assert (b["requests"], b["tokens"]) == (3, 64) and b["bound"] == "pcie"
    assert b["lone_s"] == pytest.approx(3 * slow_link["predicted_wall_s"])
    assert b["pass_s"] < 0.4 * b["lone_s"]
    busy = plan_json(capsys, "--model", model, "--tokens", "64", "--pcie-gbps", "1000",
                     "--tflops", "0.001", *rates)  # fmt: skip
    assert busy["batch"]["requests"] == 4 and busy["batch"]["bound"] == "compute"
    assert busy["batch"]["pass_s"] == pytest.approx(busy["batch"]["lone_s"], rel=0.1)
    main(["plan", "--model", str(model), *rates])
    assert "a pass of 4 prompts" in capsys.readouterr().out
