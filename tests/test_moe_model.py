"""Made Qwen3-MoE models (`make-model --arch qwen3_moe`): both expert layouts and 4-bit, as the
spec and the index read them and as mlx-lm loads and runs them; the router bias; and the decode
family's layer-at-a-time first step on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from safetensors.numpy import load_file, save_file
from tandem.nodes.decode.families import family_for
from tandem.nodes.decode.families.llama import DenseFamily, FirstStep
from tandem.nodes.model import ModelError, load_index, load_spec
from tandem.nodes.model.factory import MakeModelArgs, make_model

from tests.conftest import MakeTiny

# 4 layers, hidden 64, 8 experts of width 64, top-2; layer 1 dense (width 128: whole groups)
MOE: dict[str, Any] = {"arch": "qwen3_moe", "mlp_only_layers": (1,), "intermediate": 128}
FORMS: dict[str, dict[str, Any]] = {
    "stacked": MOE,
    "per-expert": {**MOE, "expert_layout": "per-expert"},
    "q4": {**MOE, "quantize": 4},
}
PROMPT = [5, 77, 301, 42]


def _weights(model: Path) -> dict[str, np.ndarray]:
    return load_file(str(model / "model.safetensors"))


def _routed(model: Any, prompt: list[int]) -> list[set[int]]:
    """Per routed layer, the experts the prompt's tokens choose: mlx-lm's own modules run a
    layer at a time, with the router's top-k as `Qwen3MoeSparseMoeBlock` takes it."""
    inner = model.model
    h = inner.embed_tokens(mx.array([prompt]))  # [1, T, H]
    mask = create_attention_mask(h, None)
    chosen = []
    for layer in inner.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask, None)
        x = layer.post_attention_layernorm(h)
        if hasattr(layer.mlp, "switch_mlp"):
            gates = mx.softmax(layer.mlp.gate(x), axis=-1, precise=True)  # [1, T, E]
            k = layer.mlp.top_k
            inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]  # [1, T, k]
            chosen.append({int(e) for e in np.array(inds).flat})
        h = h + layer.mlp(x)
    return chosen


@pytest.mark.parametrize("form", list(FORMS))
def test_spec_reads_the_experts(tiny_model: MakeTiny, form: str) -> None:
    spec = load_spec(tiny_model(**FORMS[form]))
    assert spec.family == "qwen3_moe" and spec.qk_norm
    assert spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.experts_per_token) == (8, 2)
    assert spec.moe.intermediate_size == 64 and spec.moe.norm_topk_prob
    assert spec.moe.sparse == (True, False, True, True)


def test_sparse_step_and_no_renormalising(tiny_model: MakeTiny) -> None:
    model = tiny_model(**{**MOE, "decoder_sparse_step": 2, "norm_topk_prob": False})
    spec = load_spec(model)
    assert spec.moe is not None and not spec.moe.norm_topk_prob
    assert spec.moe.sparse == (False, False, False, True)  # layer 1 listed, (i+1) % 2 else
    assert load_index(model).expert_layout(3) == "stacked"


@pytest.mark.parametrize("form", list(FORMS))
def test_index_reads_each_layout(tiny_model: MakeTiny, form: str) -> None:
    index = load_index(tiny_model(**FORMS[form]))
    layout = "per-expert" if form == "per-expert" else "stacked"
    assert [index.expert_layout(i) for i in range(4)] == [layout, None, layout, layout]
    layer = index.layers[0]
    assert layer["mlp.gate.weight"].shape == ((8, 16) if form == "q4" else (8, 64))
    assert "mlp.gate_proj.weight" in index.layers[1]
    if form == "per-expert":
        assert layer["mlp.experts.7.down_proj.weight"].shape == (64, 64)
        assert not any(k.startswith("mlp.switch_mlp") for k in layer)
    elif form == "stacked":
        assert layer["mlp.switch_mlp.gate_proj.weight"].shape == (8, 64, 64)  # [E, out, in]
    else:  # 4 bits in groups of 64; mlx-lm's converter keeps the router at 8 bits
        assert layer["mlp.switch_mlp.up_proj.weight"].shape == (8, 64, 8)
        assert layer["mlp.switch_mlp.up_proj.scales"].shape == (8, 64, 1)
        assert index.quant(0, "mlp.switch_mlp.up_proj").bits == 4  # type: ignore[union-attr]
        assert index.quant(0, "mlp.gate").bits == 8  # type: ignore[union-attr]


def test_both_layouts_hold_the_same_numbers(tiny_model: MakeTiny) -> None:
    stacked, per_expert = (_weights(tiny_model(**FORMS[f])) for f in ("stacked", "per-expert"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        each = [per_expert.pop(f"model.layers.2.mlp.experts.{e}.{proj}.weight") for e in range(8)]
        assert np.array_equal(
            np.stack(each), stacked[f"model.layers.2.mlp.switch_mlp.{proj}.weight"]
        )
    assert np.array_equal(stacked["lm_head.weight"], per_expert["lm_head.weight"])


def _greedy(model: Path, n: int = 12) -> list[int]:
    loaded, _ = load_model(model)
    steps = generate_step(mx.array(PROMPT), loaded, max_tokens=n)
    return [int(token) for token, _ in steps]


def test_mlx_lm_generates_the_same_from_either_layout(tiny_model: MakeTiny) -> None:
    stacked = _greedy(tiny_model(**FORMS["stacked"]))
    assert stacked == _greedy(tiny_model(**FORMS["per-expert"]))
    assert len(set(stacked)) > 1  # not one token over and over
    quantized = _greedy(tiny_model(**FORMS["q4"]))
    assert len(quantized) == 12


def test_router_bias_sends_a_short_prompt_to_few_experts(tiny_model: MakeTiny) -> None:
    unbiased, _ = load_model(tiny_model(**MOE))
    biased, _ = load_model(tiny_model(**MOE, router_bias=1.0))
    assert max(len(used) for used in _routed(unbiased, PROMPT)) > 4  # spread without it
    for used in _routed(biased, PROMPT):
        assert len(used) <= 2 * 2 and used & {0, 1}


@pytest.mark.parametrize("form", list(FORMS))
def test_decode_first_step_is_the_models_own_step(tiny_model: MakeTiny, form: str) -> None:
    assert isinstance(family_for("qwen3_moe"), DenseFamily)
    model, _ = load_model(tiny_model(**FORMS[form]))
    caches = []
    for _ in range(2):
        cache = make_prompt_cache(model)
        model(mx.array([PROMPT * 10]), cache=cache)
        caches.append(cache)
    want = model(mx.array([[123]]), cache=caches[0])[:, -1, :]
    step = FirstStep.for_model(model, 123, caches[1])
    assert step is not None
    for layer in range(4):
        step.advance(layer)
    assert mx.array_equal(step.logits(), want).item()


def _rewrite(model: Path, dest: Path, edit: Any) -> Path:
    shutil.copytree(model, dest)
    weights = _weights(dest)
    edit(weights)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize(
    ("form", "edit", "error"),
    [
        ("per-expert", lambda w: w.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
         "missing tensor model.layers.2.mlp.experts.5.up_proj.weight"),
        ("stacked", lambda w: w.update({"model.layers.0.mlp.switch_mlp.down_proj.weight":
                                        np.zeros((7, 64, 64), np.float32)}),
         r"has shape \(7, 64, 64\), expected \(8, 64, 64\)"),
        ("stacked", lambda w: [w.pop(f"model.layers.3.mlp.switch_mlp.{p}.weight")
                               for p in ("gate_proj", "up_proj", "down_proj")],
         "layer 3 routes to 8 experts but holds none"),
        ("stacked", lambda w: w.update({"model.layers.0.mlp.experts.0.up_proj.weight":
                                        np.zeros((64, 64), np.float32)}),
         "both stacked"),
        ("q4", lambda w: w.pop("model.layers.0.mlp.switch_mlp.gate_proj.scales"),
         "missing tensor model.layers.0.mlp.switch_mlp.gate_proj.scales"),
    ],
)  # fmt: skip
def test_index_names_a_bad_expert_tensor(
    tiny_model: MakeTiny, tmp_path: Path, form: str, edit: Any, error: str
) -> None:
    broken = _rewrite(tiny_model(**FORMS[form]), tmp_path / "broken", edit)
    with pytest.raises(ModelError, match=error):
        load_index(broken)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"top_k": 9}, "--top-k"),
        ({"mlp_only_layers": (4,)}, "--mlp-only-layers"),
        ({"rope_scaling": "llama3"}, "rope-scaling"),
        ({"quantize": 4, "intermediate": 176}, "multiples of --group-size"),  # layer 1 is dense
    ],
)
def test_bad_moe_arguments(tmp_path: Path, kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(ModelError, match=why):
        make_model(tmp_path / "m", MakeModelArgs(**{**MOE, **kwargs}))


def test_make_model_command_writes_qwen3_moe(tmp_path: Path) -> None:
    from tandem.app.cli.main import main

    args = ["--arch", "qwen3_moe", "--experts", "4", "--top-k", "1", "--moe-intermediate", "32"]
    args += ["--expert-layout", "per-expert", "--mlp-only-layers", "0,2", "--no-norm-topk-prob"]
    assert main(["make-model", str(tmp_path / "m"), *args, "--router-bias", "0.5"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [0, 2]
    spec = load_spec(tmp_path / "m")
    assert spec.moe is not None and spec.moe.sparse == (False, True, False, True)
    assert (spec.moe.num_experts, spec.moe.experts_per_token) == (4, 1)
    assert not spec.moe.norm_topk_prob
    assert load_index(tmp_path / "m").expert_layout(1) == "per-expert"
