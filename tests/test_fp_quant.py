"""MLX's fp quantization modes (mxfp4, mxfp8, nvfp4) on the prefill side: the config (modes,
their fixed bits and groups, mixed recipes, Hugging Face's `quant_method`), the stored
tensors, the dequantizer bit for bit against `mx.dequantize` in a few kernels, and the
engine's prefill of made llama and Qwen3-MoE models against mlx-lm's own of the same model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, load_index, stored_shapes
from tandem.nodes.model.quant import FP_MODES, Quant, parse_quantization
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.kernels import dequant
from tandem.nodes.prefill.kernels.dequant import dequantize, temp_bytes_per_row

from tests.conftest import MakeTiny
from tests.test_dequant_kernels import Launches
from tests.test_gemma3_prefill import mlx_prefill
from tests.test_moe_prefill import assert_matches
from tests.test_quantized import MX_TO_TORCH, _bits, _torch

MODES = list(FP_MODES)
DTYPES = [mx.float32, mx.bfloat16, mx.float16]
LLAMA = {"arch": "llama", "layers": 2, "hidden": 128, "intermediate": 256}
MOE = {"arch": "qwen3_moe", "layers": 3, "hidden": 128, "intermediate": 256, "experts": 8,
       "top_k": 2, "moe_intermediate": 64, "mlp_only_layers": (1,)}  # fmt: skip
N = 24  # prompt tokens


def test_each_mode_with_its_bits_and_group() -> None:
    cfg = parse_quantization({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, "c")
    assert cfg.of("model.layers.0.mlp.up_proj") == Quant(4, 32, "mxfp4")
    assert not cfg.of("m").biases and Quant(4, 64).biases  # affine alone stores biases
    for mode, (bits, group) in FP_MODES.items():  # null or missing: the mode's own
        raw = {"quantization": {"bits": None, "group_size": None, "mode": mode}}
        assert parse_quantization(raw, "c").of("m") == Quant(bits, group, mode)
    for raw, says in (
        ({"bits": 8, "group_size": 32, "mode": "mxfp4"}, "mxfp4 with 8-bit groups of 32"),
        ({"bits": 4, "group_size": 32, "mode": "nvfp4"}, "4-bit values in groups of 16"),
        ({"bits": 4, "group_size": 32, "mode": "mxfp8"}, "mxfp8 stores 8-bit values"),
        ({"bits": 4, "group_size": 64, "mode": "fp4"}, "mode 'fp4'"),
    ):  # fmt: skip
        with pytest.raises(ModelError, match=says):
            parse_quantization({"quantization": raw}, "config.json")


def test_a_mixed_recipe_gives_each_module_its_own_mode() -> None:
    """An override is what mlx-lm hands `to_quantized`: without a mode it is affine, even in
    an fp model (mlx-lm's Qwen3-MoE router at 8 bits)."""
    experts = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    cfg = parse_quantization(
        {"quantization": {"group_size": 64, "bits": 8, "mode": "affine",
                          "model.layers.0.mlp.switch_mlp.up_proj": experts,
                          "model.layers.0.self_attn.q_proj": {"mode": "nvfp4", "bits": 4}}},
        "c",
    )  # fmt: skip
    assert cfg.of("model.layers.0.mlp.switch_mlp.up_proj") == Quant(4, 32, "mxfp4")
    assert cfg.of("model.layers.0.self_attn.q_proj") == Quant(4, 16, "nvfp4")
    assert cfg.of("model.layers.0.self_attn.k_proj") == Quant(8, 64)
    router = {"group_size": 64, "bits": 8, "mode": "mxfp4", "model.layers.0.mlp.gate":
              {"group_size": 64, "bits": 8}}  # fmt: skip
    with pytest.raises(ModelError, match="mxfp4 with 8-bit groups of 64"):
        parse_quantization({"quantization": router}, "c")  # the default's mode is its own
    router.update(bits=4, group_size=32)
    assert parse_quantization({"quantization": router}, "c").of("model.layers.0.mlp.gate") == (
        Quant(8, 64)
    )  # fmt: skip


def test_hugging_face_quant_method_mxfp4_spares_modules_to_not_convert() -> None:
    """OpenAI's gpt-oss config: mxfp4 but for the listed modules (patterns, prefixes)."""
    cfg = parse_quantization(
        {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}},
        "c",
    )  # fmt: skip
    assert cfg.quantized
    assert cfg.of("model.layers.7.mlp.experts.gate_up_proj") == Quant(4, 32, "mxfp4")
    for module in ("model.layers.7.self_attn.q_proj", "model.layers.0.mlp.router",
                   "model.embed_tokens", "lm_head"):  # fmt: skip
        assert cfg.of(module) is None, module
    mxfp8 = parse_quantization({"quantization_config": {"quant_method": "mxfp8"}}, "c")
    assert mxfp8.of("m") == Quant(8, 32, "mxfp8")
    with pytest.raises(ModelError, match="'awq' quantization is not supported"):
        parse_quantization({"quantization_config": {"quant_method": "awq"}}, "c")
    with pytest.raises(ModelError, match="modules_to_not_convert must be a list"):
        parse_quantization(
            {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": "x"}}, "c"
        )


def test_an_fp_module_stores_words_and_byte_scales_only() -> None:
    for mode, (bits, group) in FP_MODES.items():
        stored = stored_shapes(
            "mlp.switch_mlp.up_proj.weight", (8, 64, 256), Quant(bits, group, mode)
        )
        assert stored == {
            "mlp.switch_mlp.up_proj.weight": ((8, 64, 256 * bits // 32), ("U32",)),
            "mlp.switch_mlp.up_proj.scales": ((8, 64, 256 // group), ("U8",)),
        }


def _codes(mode: str, rows: int = 256, cols: int = 512, seed: int = 0) -> tuple[Any, Any]:
    """Random packed words and scales as mlx arrays, row 0's first 256 bytes every byte value
    (every e2m1 pair, every e4m3 code with its NaNs) and the first group's scales every scale
    code down the rows (e8m0's 2^-127 .. 2^127 and 255; e4m3's subnormals and NaNs)."""
    bits, group = FP_MODES[mode]
    rng = np.random.default_rng(seed)
    by = rng.integers(0, 256, (rows, cols * bits // 8), dtype=np.uint8)
    by[0, :256] = np.arange(256)
    scales = rng.integers(0, 256, (rows, cols // group), dtype=np.uint8)
    scales[:, 0] = np.arange(rows) % 256
    return mx.array(by.view(np.uint32)), mx.array(scales)


def _same(ours: torch.Tensor, ref: mx.array) -> None:
    """Bit for bit; NaN where mlx's is (its sign and payload are the arithmetic's)."""
    theirs = _torch(ref)
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(_bits(ours)[~nan], _bits(theirs)[~nan])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_dequantize_is_mx_dequantize_bit_for_bit(mode: str, dtype: mx.Dtype) -> None:
    bits, group = FP_MODES[mode]
    quant, t = Quant(bits, group, mode), MX_TO_TORCH[dtype]
    words, scales = _codes(mode)
    ref = mx.dequantize(words, scales, None, group, bits, mode=mode, dtype=dtype)
    ours = dequantize(_torch(words), _torch(scales), None, quant, t)
    assert ours.dtype == t and ours.shape == ref.shape
    assert _torch(ref).isnan().any()  # the codes and scales that make NaN are there
    _same(ours, ref)
    # what mx.quantize makes of weights over a wide range of magnitudes
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((64, 256)) * 10.0 ** rng.uniform(-12, 12, (64, 1))
    words, scales = mx.quantize(mx.array(x.astype(np.float32)).astype(dtype), mode=mode)
    ref = mx.dequantize(words, scales, mode=mode, dtype=dtype)
    _same(dequantize(_torch(words), _torch(scales), None, quant, t), ref)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_of_what_is_lent_stay_bit_for_bit(mode: str, monkeypatch: pytest.MonkeyPatch):
    """Too little room lent (and off a 4-byte boundary), a small BLOCK_BYTES: rows in blocks."""
    bits, group = FP_MODES[mode]
    words, scales = _codes(mode, rows=37)
    ref = mx.dequantize(words, scales, None, group, bits, mode=mode, dtype=mx.bfloat16)
    monkeypatch.setattr(dequant, "BLOCK_BYTES", 4096)
    odd = torch.empty(4099, dtype=torch.uint8)[3:]
    ours = dequantize(_torch(words), _torch(scales), None, Quant(bits, group, mode),
                      torch.bfloat16, temp=odd)  # fmt: skip
    _same(ours, ref)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_a_matrix_takes_a_few_kernels(mode: str, compute: torch.dtype) -> None:
    """A 70B-wide matrix in one block of 5 kernels (bytes and scales widened to indices, two
    gathers, one product) where the lent room is what `temp_bytes_per_row` says: nothing
    allocated; the same count for four times the rows."""
    bits, group = FP_MODES[mode]
    quant, counts = Quant(bits, group, mode), []
    dequant._tables(mode, compute, torch.device("cpu"))  # made once per dtype and device
    for rows in (96, 384):
        words, scales = (_torch(a) for a in _codes(mode, rows, 8192))
        out = torch.empty((rows, 8192), dtype=compute)
        per_row = temp_bytes_per_row(8192, bits, scales.dtype, compute)
        assert per_row == 8192 * bits // 2  # an int32 index per packed byte
        temp = torch.empty(rows * per_row, dtype=torch.uint8)
        with Launches() as count:
            dequantize(words, scales, None, quant, compute, out, temp)
        assert count.allocations == 0
        counts.append(len(count.ops))
    assert counts[0] == counts[1] <= 11, counts


def test_dequantize_refuses_biases_or_float_scales_in_an_fp_mode() -> None:
    words, scales = torch.zeros((4, 8), dtype=torch.int32), torch.zeros((4, 2), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"do not describe 4-bit groups of 32 \(mxfp4\)"):
        dequantize(words, scales, scales, Quant(4, 32, "mxfp4"), torch.float32)
    with pytest.raises(ValueError, match="do not describe"):
        dequantize(words, scales.float(), None, Quant(4, 32, "mxfp4"), torch.float32)
    with pytest.raises(ValueError, match=r"\(affine\)"):
        dequantize(words, scales.float(), None, Quant(4, 32), torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_dequantize_on_cuda_is_mx_dequantize_bit_for_bit(mode: str) -> None:
    bits, group = FP_MODES[mode]
    words, scales = _codes(mode, rows=512, cols=4096)
    for dtype in DTYPES:
        ref = mx.dequantize(words, scales, None, group, bits, mode=mode, dtype=dtype)
        ours = dequantize(_torch(words).cuda(), _torch(scales).cuda(), None,
                          Quant(bits, group, mode), MX_TO_TORCH[dtype])  # fmt: skip
        _same(ours.cpu(), ref)


def _recipe(path: str, module: Any) -> bool | dict[str, Any]:
    """A mixed recipe: experts mxfp4, attention nvfp4, a dense MLP mxfp8; the rest (embedding,
    router, head) the default, affine 8 bits in groups of 64."""
    for part, mode in (("switch_mlp", "mxfp4"), ("self_attn", "nvfp4"), ("mlp.", "mxfp8")):
        if part in path and not path.endswith("mlp.gate"):
            bits, group = FP_MODES[mode]
            return {"group_size": group, "bits": bits, "mode": mode}
    return True


@pytest.fixture(scope="module")
def made(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`made(arch, mode)`: the tiny model in `mode` by `tandem make-model`'s factory, or
    "mixed": mlx-lm's converter with `_recipe`."""
    from mlx_lm import convert

    def make(arch: str, mode: str) -> Path:
        shape = LLAMA if arch == "llama" else MOE
        if mode != "mixed":
            return tiny_model(**shape, quantize=FP_MODES[mode][0], q_mode=mode)
        out = tmp_path_factory.mktemp(f"{arch}-mixed") / "model"
        convert(str(tiny_model(**shape)), str(out), quantize=True, q_bits=8, q_group_size=64,
                dtype="float32", quant_predicate=_recipe)  # fmt: skip
        return out

    return make


@pytest.fixture
def open_engine() -> Iterator[Callable[..., PrefillEngine]]:
    engines: list[PrefillEngine] = []

    def make(model: Path, budget: int) -> PrefillEngine:
        engines.append(PrefillEngine(model, budget=budget, device="cpu", chunk_tokens=8))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("budget", ["tight", "roomy"])
@pytest.mark.parametrize("mode", [*MODES, "mixed"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_prefill_matches_mlx_lm_on_the_same_model(
    arch: str, mode: str, budget: str, made: Callable[..., Path],
    open_engine: Callable[..., PrefillEngine],
) -> None:  # fmt: skip
    """ "tight": a layer's bytes (llama) or half of them (Qwen3-MoE): attention cut by KV
    heads, o_proj and down_proj rows dequantized in blocks, experts streamed a few at a time;
    "roomy": every layer resident and dequantized once."""
    import mlx_lm

    model = made(arch, mode)
    index = load_index(model)
    want = (
        {mode}
        if mode != "mixed"
        else {"nvfp4", "mxfp8"} | ({"mxfp4"} if arch != "llama" else set())
    )
    want |= {"affine"} if arch == "qwen3_moe" else set()  # mlx-lm's router: affine, 8 bits
    assert _modes(index) == want
    tight = index.layer_bytes(0) // (1 if arch == "llama" else 2)
    engine = open_engine(model, tight if budget == "tight" else 10**9)
    assert all(ld.resident for ld in engine.plan.loads) == (budget == "roomy")
    tokens = np.random.default_rng(N).integers(0, 512, N).tolist()
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(mlx_lm.load(str(model))[0], tokens))


def _modes(index: ModelIndex) -> set[str]:
    """The modes of the quantized matrices in the layers."""
    quants = (index.quant(i, key.removesuffix(".scales")) for i, layer in enumerate(index.layers)
              for key in layer if key.endswith(".scales"))  # fmt: skip
    return {q.mode for q in quants if q is not None}


def test_make_model_q_mode_implies_the_bits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.app.cli.main import main

    shape = ["--layers", "1", "--hidden", "64", "--intermediate", "128"]
    assert main(["make-model", str(tmp_path / "m"), "--q-mode", "nvfp4", *shape]) == 0
    quantization = json.loads((tmp_path / "m" / "config.json").read_text())["quantization"]
    assert quantization == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    assert load_index(tmp_path / "m").quant(0, "mlp.up_proj") == Quant(4, 16, "nvfp4")
    capsys.readouterr()
    assert main(["make-model", str(tmp_path / "x"), "--q-mode", "mxfp8", "--quantize", "4",
                 *shape]) == 2  # fmt: skip
    assert "--q-mode mxfp8 stores 8 bits, not 4" in capsys.readouterr().err


def test_a_global_scale_is_refused_in_one_clear_error(made: Callable[..., Path], tmp_path: Path):
    """mlx-lm's per-expert nvfp4 tensor scale: mlx runs it on the GPU only, tandem not yet."""
    model = made("qwen3_moe", "nvfp4")
    for f in model.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).symlink_to(f)
    weights = mx.load(str(model / "model.safetensors"))
    weights["model.layers.0.mlp.switch_mlp.up_proj.global_scale"] = mx.ones((8,))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, {"format": "mlx"})
    with pytest.raises(ModelError, match=r"switch_mlp.up_proj.global_scale: nvfp4 with a global"):
        load_index(tmp_path)
