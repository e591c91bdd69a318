"""MLX quantized checkpoints on the prefill side: the config, the dequantizer bit for bit
against `mx.dequantize`, the plan's packed loads and scratch, and `tandem prefill` of made
quantized models against mlx-lm's own prefill of the same quantized model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import load_index
from tandem.nodes.model.quant import Quant, parse_quantization
from tandem.nodes.prefill.kernels.dequant import dequantize
from tandem.nodes.prefill.planning.loads import dequantized_bytes, dequantized_sizes
from tandem.nodes.prefill.planning.plan import make_plan
from tandem.nodes.prefill.planning.scratch import TIGHT_TEMP_ROWS, temp_room

from tests.conftest import MakeTiny

ROOT = Path(__file__).resolve().parents[1]
MX_TO_TORCH = {mx.float16: torch.float16, mx.bfloat16: torch.bfloat16, mx.float32: torch.float32}
# hidden and intermediate are multiples of 128 so every group size cuts whole groups
SHAPE = {"arch": "llama", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2,
         "intermediate": 1024, "vocab": 512, "shards": 2}  # fmt: skip


def _torch(a: mx.array) -> torch.Tensor:
    """An mlx array's exact bits as a torch tensor (bf16 through its uint16 bits)."""
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32))
    return torch.from_numpy(np.array(a))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequantize_is_mx_dequantize_bit_for_bit(bits: int, group: int, dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(bits * 1000 + group)
    for rows, cols in ((37, 3 * 128), (1, 128), (129, 640)):
        x = mx.array((rng.standard_normal((rows, cols)) * 3).astype(np.float32)).astype(dtype)
        x = mx.concatenate([x[:, :-group], mx.zeros((rows, group), dtype)], axis=1)  # a zero group
        words, scales, biases = mx.quantize(x, group_size=group, bits=bits)
        ref = mx.dequantize(words, scales, biases, group_size=group, bits=bits)
        t = MX_TO_TORCH[dtype]
        ours = dequantize(_torch(words), _torch(scales), _torch(biases), Quant(bits, group), t)
        assert ours.dtype == t and ours.shape == (rows, cols)
        assert torch.equal(_bits(ours), _bits(_torch(ref))), (rows, cols)


def test_dequantize_widens_narrow_scales_for_a_float32_model() -> None:
    """fp16 scales beside float32 norms (SmolLM2's GGUF): dequantized as mlx's float32 matmul
    sees them, from the scales widened to float32."""
    x = mx.array(np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32))
    words, scales, biases = mx.quantize(x.astype(mx.float16), group_size=32, bits=4)
    ref = mx.dequantize(words, scales.astype(mx.float32), biases.astype(mx.float32), 32, 4)
    ours = dequantize(_torch(words), _torch(scales), _torch(biases), Quant(4, 32), torch.float32)
    assert torch.equal(ours, _torch(ref))


def test_dequantize_refuses_shapes_that_disagree() -> None:
    words = torch.zeros((4, 7), dtype=torch.int32)  # 2 groups of 32 at 4 bits need 8 words
    scales = torch.ones((4, 2))
    with pytest.raises(ValueError, match="do not describe 4-bit groups of 32"):
        dequantize(words, scales, scales, Quant(4, 32), torch.float32)


def test_quantization_config_defaults_overrides_and_refusals() -> None:
    cfg = parse_quantization(
        {"quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                          "model.embed_tokens": {"bits": 8, "group_size": None},
                          "lm_head": False, "model.layers.0.mlp.down_proj": {"bits": 6,
                                                                           "group_size": 32}}},
        "config.json",
    )  # fmt: skip
    assert cfg.of("model.layers.3.self_attn.q_proj") == Quant(4, 64)
    assert cfg.of("model.embed_tokens") == Quant(8, 64)  # null: the mode's default
    assert cfg.of("lm_head") is None
    assert cfg.of("model.layers.0.mlp.down_proj") == Quant(6, 32)
    assert not parse_quantization({}, "c").quantized
    only_overrides = parse_quantization({"quantization_config": {"m": {"bits": 2}}}, "c")
    assert only_overrides.of("m") == Quant(2, 64) and only_overrides.of("x") is None
    with pytest.raises(ModelError, match=r"mode 'mxfp6' \(used by every module\)"):
        parse_quantization({"quantization": {"bits": 6, "group_size": 32, "mode": "mxfp6"}}, "c")
    with pytest.raises(ModelError, match=r"'int4' \(used by model.layers.1.mlp.up_proj\)"):
        parse_quantization(
            {"quantization": {"bits": 4, "model.layers.1.mlp.up_proj": {"mode": "int4",
                                                                         "bits": 4}}}, "c"
        )  # fmt: skip
    with pytest.raises(ModelError, match="'gptq' quantization is not supported"):
        parse_quantization({"quantization_config": {"quant_method": "gptq"}}, "c")
    with pytest.raises(ModelError, match="7-bit groups of 64"):
        parse_quantization({"quantization": {"bits": 7, "group_size": 64}}, "c")


@pytest.fixture(scope="module")
def q4(tiny_model: MakeTiny) -> Path:
    """4-bit, groups of 64, float32 scales: mlx-lm's converter with `dtype="float32"`."""
    return tiny_model(**SHAPE, quantize=4, group_size=64)


@pytest.fixture(scope="module")
def mixed(tiny_model: MakeTiny) -> Path:
    """mlx-lm's mixed_3_6 recipe: 3 and 6 bits by layer, both crossing word boundaries."""
    return tiny_model(**SHAPE, recipe="mixed_3_6", group_size=64)


def test_an_unsupported_mode_is_refused_in_one_line_naming_it(q4: Path, tmp_path: Path) -> None:
    model = tmp_path / "mxfp6"
    model.mkdir()
    for f in q4.iterdir():
        (model / f.name).symlink_to(f)
    config = json.loads((q4 / "config.json").read_text())
    config["quantization"]["model.layers.2.mlp.gate_proj"] = {"mode": "mxfp6", "bits": 6,
                                                              "group_size": 32}  # fmt: skip
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    done = _tandem("prefill", "--model", model, "--tokens-file", _tokens(tmp_path, 8),
                   "--out", tmp_path / "c.safetensors")  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'mxfp6'" in lines[0] and "model.layers.2.mlp.gate_proj" in lines[0]
    assert "corrupt" not in lines[0]


def test_the_plan_streams_packed_bytes_and_counts_the_scratch(q4: Path, tiny_model: MakeTiny):
    index = load_index(q4)
    assert index.quantized and index.dtype == "F32"
    packed = sum(index.layer_bytes(i) for i in range(4))
    bf16 = load_index(tiny_model(**SHAPE, dtype="bfloat16"))
    ratio = packed / sum(bf16.layer_bytes(i) for i in range(4))
    assert ratio <= 0.32  # 4 bits + a float32 scale and bias per 64 values: 0.25 + 0.0625
    for budget in (packed // 4, index.layer_bytes(0) // 2):
        plan = make_plan(index, budget)
        parts = [p for ld in plan.loads for p in ld.parts]
        whole = max(dequantized_bytes(index, p, 4) for p in parts)  # a part's matrices at once
        # or one matrix at a time, o_proj's and down_proj's rows in blocks of that size
        one = max(
            s // (p.hi - p.lo) if p.op in ("o", "down") else s
            for p in parts
            for s in dequantized_sizes(index, p, 4)
        )
        # and after it, room for the temporaries of dequantizing a matrix (all of them, or
        # a block of rows' where the budget is tight: the most of TIGHT_TEMP_ROWS that fit)
        tight = [one + temp_room(index, parts, False, rows) for rows in TIGHT_TEMP_ROWS]
        rooms = (whole + temp_room(index, parts), *tight)
        assert plan.scratch_bytes in rooms and one > 0
        assert plan.device_bytes <= budget
        for ld in plan.loads:  # packed bytes as stored: exactly the checkpoint's tensors
            for piece in ld.pieces:
                if piece.key.endswith(".weight") and piece.entry.dtype == "U32":
                    assert math.prod(piece.shape) * 4 == piece.nbytes
    with pytest.raises(ModelError, match="raise --budget"):
        make_plan(index, index.layer_bytes(0) // 40)


@pytest.mark.parametrize("bits", [2, 5, 8])
def test_tight_budgets_plan_with_the_scratch_counted(bits: int, tiny_model: MakeTiny) -> None:
    """Regression: cutting o_proj and down_proj by rows grew the slices' dequantized
    matrices, and budgets that planned before failed ("cannot hold one slice"); the planner
    now tries slice sizes in small steps."""
    shape = {**SHAPE, "layers": 2, "intermediate": 256, "shards": 1}
    model = tiny_model(**shape, quantize=bits, group_size=64)
    index = load_index(model)
    first = {2: 43000, 5: 55000, 8: 61000}[bits]  # planned before the row cut, in each range
    for budget in range(first, first + 6001, 1500):
        for direct in (False, True):
            plan = make_plan(index, budget, direct=direct)
            assert plan.device_bytes <= budget


def _tokens(tmp: Path, n: int, seed: int = 3) -> Path:
    path = tmp / f"tokens-{n}.json"
    path.write_text(json.dumps(np.random.default_rng(seed).integers(0, 512, n).tolist()))
    return path


def _tandem(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.app", *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("which", ["q4", "mixed"])
@pytest.mark.parametrize("budget_name", ["quarter", "half_layer"])
def test_prefill_of_a_quantized_model_matches_mlx_lm_on_the_same_model(
    request: pytest.FixtureRequest, which: str, budget_name: str, tmp_path: Path
) -> None:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

    model_dir: Path = request.getfixturevalue(which)
    index = load_index(model_dir)
    packed = sum(index.layer_bytes(i) for i in range(4))
    budget = packed // 4 if budget_name == "quarter" else index.layer_bytes(0) // 2
    n = 120
    tokens_file = _tokens(tmp_path, n)
    tokens = json.loads(tokens_file.read_text())
    out, stats_file = tmp_path / "cache.safetensors", tmp_path / "stats.json"
    done = _tandem(
        "prefill", "--model", model_dir, "--tokens-file", tokens_file, "--out", out,
        "--budget", budget, "--chunk-tokens", 48, "--stats-json", stats_file,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    stats = json.loads(stats_file.read_text())
    plan = make_plan(index, budget, direct=True)
    streamed = sum(ld.weight_bytes for ld in plan.loads)
    assert stats["bytes_streamed"] == streamed == packed  # one request: every load once
    assert stats["peak_weight_bytes"] <= budget

    model, _ = load(str(model_dir))
    ref = make_prompt_cache(model)
    model(mx.array([tokens]), cache=ref)
    ours = load_prompt_cache(str(out))
    for a, b in zip(ours, ref, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            np.testing.assert_allclose(np.array(x), np.array(y[..., :n, :]), rtol=0, atol=1e-4)

    # greedy continuation from our cache of tokens 0..n-2, against mlx-lm from scratch
    def greedy(cache: list, prompt: list[int]) -> list[int]:
        steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=12)
        return [int(t) for t, _ in steps]

    head = tmp_path / "head.json"
    head.write_text(json.dumps(tokens[:-1]))
    done = _tandem("prefill", "--model", model_dir, "--tokens-file", head, "--out", out,
                   "--budget", budget)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert greedy(load_prompt_cache(str(out)), tokens[-1:]) == greedy(make_prompt_cache(model),
                                                                      tokens)  # fmt: skip
