"""gpt-oss quantized as its checkpoints come: mlx-lm's converter in each of mlx's fp modes
(`--q-mode mxfp4`, `nvfp4`, `mxfp8`), OpenAI's own layout (MXFP4 experts as `*_blocks` and
`*_scales`, gate and up interleaved, the rest float), and mlx-community's MXFP4-Q8 (that
checkpoint converted by mlx-lm with 8-bit affine for everything but the experts). Each
prefill's K/V equal mlx-lm's own prefill of the same checkpoint within the affine tests' bound,
at a quarter budget; OpenAI's layout and mlx-lm's conversion of it give the same K/V."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine

from tests.conftest import MakeTiny
from tests.test_gemma3_prefill import mlx_prefill
from tests.test_gpt_oss import ARGS, BUDGETS, assert_matches, prompt

N = 40  # prompt tokens: past the window of 16


def _prefill(engine_of: Callable[..., PrefillEngine], model: Path, tokens: list[int]) -> list:
    engine = engine_of(model, budget=BUDGETS["quarter"](load_index(model)))
    return list(engine.prefill(tokens))


@pytest.mark.parametrize(("mode", "bits"), [("mxfp4", 4), ("nvfp4", 4), ("mxfp8", 8)])
def test_mlx_fp_modes_match_mlx_lm(
    mode: str, bits: int, tiny_model: MakeTiny, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    model = tiny_model(**ARGS, q_mode=mode, quantize=bits)
    spec = load_index(model).spec
    assert spec.quantization.of("model.layers.0.mlp.experts.gate_proj").mode == mode
    router = spec.quantization.of("model.layers.0.mlp.router")  # mlx-lm's gpt_oss predicate
    assert router is not None and (router.mode, router.bits) == ("affine", 8)
    tokens = prompt(N)
    assert_matches(
        _prefill(cpu_engine, model, tokens), mlx_prefill(mlx_lm.load(str(model))[0], tokens)
    )


@pytest.fixture(scope="module")
def openai_layout(tiny_model: MakeTiny) -> Path:
    return tiny_model(**ARGS, layout="hf")


def _convert(src: Path, dest: Path, **kwargs: object) -> Path:
    from mlx_lm import convert

    convert(str(src), str(dest), **kwargs)  # type: ignore[arg-type]
    return dest


def test_openai_layout_and_its_mlx_conversions(
    openai_layout: Path, tmp_path: Path, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    index = load_index(openai_layout)
    assert index.expert_layout(0) == "fused"
    assert index.quant(0, "mlp.experts.gate_up_proj").mode == "mxfp4"
    assert index.quant(0, "self_attn.q_proj") is None  # modules_to_not_convert
    tokens = prompt(N, seed=1)
    ours = _prefill(cpu_engine, openai_layout, tokens)
    assert_matches(ours, mlx_prefill(mlx_lm.load(str(openai_layout))[0], tokens))
    # mlx-lm's own conversion: the experts split into gate and up, still MXFP4
    mlx_layout = _convert(openai_layout, tmp_path / "mlx")
    assert load_index(mlx_layout).expert_layout(0) == "stacked"
    theirs = _prefill(cpu_engine, mlx_layout, tokens)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a.k.numpy(), b.k.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(a.v.numpy(), b.v.numpy(), rtol=0, atol=1e-5)
    # mlx-community's MXFP4-Q8: the experts MXFP4, everything else 8-bit affine
    q8 = _convert(openai_layout, tmp_path / "q8", quantize=True, q_bits=8, q_group_size=64)
    q8_index = load_index(q8)
    assert q8_index.quant(0, "self_attn.q_proj").mode == "affine"
    assert q8_index.quant(0, "mlp.experts.gate_proj").mode == "mxfp4"
    assert_matches(_prefill(cpu_engine, q8, tokens), mlx_prefill(mlx_lm.load(str(q8))[0], tokens))
