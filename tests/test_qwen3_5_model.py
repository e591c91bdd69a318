"""Qwen3.5 (qwen3_5, qwen3_5_moe): the spec from nested and flat configs, the index over the
mlx and Hugging Face layouts, and mlx-lm as the oracle that both layouts are one model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.factory import MakeModelArgs, make_model
from tandem.nodes.model.index import load_index
from tandem.nodes.model.safetensors_format import RawTensor, encode, read_header
from tandem.nodes.model.spec import FULL, LayerKind, LinearSpec, load_spec

ARGS = {
    "qwen3_5": MakeModelArgs(arch="qwen3_5", layers=4, vocab=320),
    "qwen3_5_moe": MakeModelArgs(arch="qwen3_5_moe", layers=4, vocab=320, shared_intermediate=32),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each arch in both layouts, the same numbers."""
    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        (arch, layout): make_model(root / f"{arch}-{layout}", _replace(args, layout=layout))
        for arch, args in ARGS.items()
        for layout in ("mlx", "hf")
    }


def _replace(args: MakeModelArgs, **kw: object) -> MakeModelArgs:
    import dataclasses

    return dataclasses.replace(args, **kw)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_spec_from_the_nested_config(made: dict[tuple[str, str], Path], arch: str) -> None:
    spec = load_spec(made[arch, "hf"])
    assert spec.family == arch
    assert spec.layer_kinds == (LayerKind("linear"),) * 3 + (FULL,)
    assert spec.linear == LinearSpec(2, 4, 32, 32, 4)
    assert (spec.linear.key_dim, spec.linear.value_dim, spec.linear.conv_dim) == (64, 128, 256)
    assert spec.linear.state_bytes(2) == 3 * 256 * 2 + 4 * 32 * 32 * 4
    assert spec.partial_rotary_factor == 0.25 and spec.attn_output_gate and spec.qk_norm
    assert spec.rope_theta == 10_000_000.0 and spec.rope_scaling is None
    assert not spec.tie_word_embeddings and spec.eos_token_ids
    if arch == "qwen3_5":
        assert spec.moe is None
    else:
        assert spec.moe is not None
        assert spec.moe.sparse == (True,) * 4 and spec.moe.norm_topk_prob
        assert (spec.moe.num_experts, spec.moe.experts_per_token) == (8, 2)
        assert spec.moe.shared_intermediate_size == 32


def test_spec_from_a_flat_config_with_mlx_defaults(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen3_5_moe", "hidden_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 16, "full_attention_interval": 2,
        "rope_parameters": {"type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "eos_token_id": 7,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_spec(tmp_path)
    assert [k.kind for k in spec.layer_kinds] == ["linear", "full"] * 4
    assert spec.linear == LinearSpec(16, 64, 192, 128, 4)  # mlx-lm's defaults
    assert spec.rope_theta == 5e6 and spec.partial_rotary_factor == 0.5
    assert spec.eos_token_ids == (7,) and spec.head_dim == 16
    assert spec.moe is not None and spec.moe.norm_topk_prob


def test_spec_refuses_a_scaled_rope(tmp_path: Path) -> None:
    config = {"model_type": "qwen3_5", "text_config": {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 320,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="unsupported rope scaling"):
        load_spec(tmp_path)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_index_names_both_layouts_alike(made: dict[tuple[str, str], Path], arch: str) -> None:
    mlx, hf = load_index(made[arch, "mlx"]), load_index(made[arch, "hf"])
    assert (mlx.norm_offset, hf.norm_offset) == (0.0, 1.0)
    assert set(mlx.globals) == set(hf.globals) == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
    }  # fmt: skip
    assert mlx.layers[0]["linear_attn.conv1d.weight"].shape == (256, 4, 1)
    assert hf.layers[0]["linear_attn.conv1d.weight"].shape == (256, 1, 4)
    assert hf.layers[3]["self_attn.q_proj.weight"].shape == (2 * 4 * 16, 64)  # q and gate
    assert "linear_attn.in_proj_qkv.weight" not in mlx.layers[3]
    assert hf.layers[0]["input_layernorm.weight"].name.startswith("model.language_model.")
    assert mlx.layers[0]["input_layernorm.weight"].name.startswith("language_model.model.")
    if arch == "qwen3_5_moe":
        assert [mlx.expert_layout(i) for i in range(4)] == ["stacked"] * 4
        assert [hf.expert_layout(i) for i in range(4)] == ["fused"] * 4
        assert hf.layers[1]["mlp.experts.gate_up_proj"].shape == (8, 128, 64)
        assert hf.layers[1]["mlp.experts.down_proj"].shape == (8, 64, 64)
        assert hf.layers[1]["mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert _stored_norm(hf, "model.norm.weight") + 1 == pytest.approx(
        _stored_norm(mlx, "model.norm.weight"), abs=1e-6
    )


def _stored_norm(index: object, name: str) -> np.ndarray:
    entry = index.globals[name]  # type: ignore[attr-defined]
    with open(entry.file, "rb") as f:
        f.seek(entry.offset)
        return np.frombuffer(f.read(entry.nbytes), dtype=np.float32)


def _rewrite(src: Path, dst: Path, edit: object) -> Path:
    """A copy of `src` with its tensors passed through `edit(dict) -> dict`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    raw = (src / "model.safetensors").read_bytes()
    with open(src / "model.safetensors", "rb") as fh:
        entries, _, start = read_header(fh)
    tensors = {
        n: RawTensor(h.dtype, h.shape, raw[start + h.begin : start + h.end])
        for n, h in entries.items()
    }
    (dst / "model.safetensors").write_bytes(encode(edit(tensors), {"format": "pt"}))  # type: ignore[operator]
    return dst


def test_index_skips_vision_and_mtp(made: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    extra = RawTensor("F32", (2,), bytes(8))
    names = ("model.visual.blocks.0.weight", "mtp.fc.weight", "vision_tower.x.weight")
    copy = _rewrite(
        made["qwen3_5", "hf"], tmp_path / "m", lambda t: {**t, **dict.fromkeys(names, extra)}
    )
    index = load_index(copy)
    assert set(index.globals) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }


L = "model.language_model.layers."


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        (L + "1.linear_attn.dt_bias", "drop", "missing tensor model.layers.1.linear_attn.dt_bias"),
        (L + "3.self_attn.q_proj.weight", "halve", r"expected \(128, 64\)"),
        (L + "2.mlp.experts.down_proj", "drop", "missing tensor model.layers.2.mlp.experts.down"),
        (L + "0.mlp.shared_expert_gate.weight", "drop", "shared_expert_gate"),
    ],
)  # fmt: skip
def test_index_names_a_missing_or_misshaped_tensor(
    made: dict[tuple[str, str], Path], tmp_path: Path, name: str, edit: str, message: str
) -> None:
    def change(t: dict[str, RawTensor]) -> dict[str, RawTensor]:
        if edit == "drop":
            return {k: v for k, v in t.items() if k != name}
        v = t[name]
        half = (v.shape[0] // 2, *v.shape[1:])
        return {**t, name: RawTensor(v.dtype, half, v.data[: len(v.data) // 2])}

    copy = _rewrite(made["qwen3_5_moe", "hf"], tmp_path / "m", change)
    with pytest.raises(ModelError, match=message):
        load_index(copy)


def _logits(path: Path, prompt: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    out = model(mx.array([prompt]))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_mlx_lm_reads_both_layouts_as_one_model(
    made: dict[tuple[str, str], Path], arch: str
) -> None:
    prompt = [5, 77, 300, 12, 9, 140, 33]
    mlx, hf = _logits(made[arch, "mlx"], prompt), _logits(made[arch, "hf"], prompt)
    assert mlx.shape == (1, len(prompt), 320) and np.isfinite(mlx).all()
    np.testing.assert_allclose(hf, mlx, atol=1e-5, rtol=0)
    assert np.abs(mlx).max() > 1e-3  # not a degenerate model


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_quantized_loads_and_runs(tmp_path: Path, arch: str) -> None:
    args = _replace(ARGS[arch], quantize=4, shared_intermediate=64, intermediate=128)
    path = make_model(tmp_path / "q4", args)
    index = load_index(path)
    proj = index.quant(0, "linear_attn.in_proj_qkv")
    assert proj is not None and (proj.bits, proj.group_size) == (4, 64)
    assert index.quant(0, "linear_attn.conv1d") is None
    if arch == "qwen3_5_moe":  # the model's quant_predicate: routers at 8 bits
        for module in ("mlp.gate", "mlp.shared_expert_gate"):
            q = index.quant(2, module)
            assert q is not None and (q.bits, q.group_size) == (8, 64), module
    logits = _logits(path, [5, 77, 300])
    assert logits.shape == (1, 3, 320) and np.isfinite(logits).all()


def test_cli_writes_the_hf_layout_with_its_flags(tmp_path: Path) -> None:
    from tandem.app.cli.main import main

    out = tmp_path / "m"
    flags = ["--layers", "4", "--full-attention-interval", "2", "--linear-v-heads", "2"]
    more = ["--experts", "4", "--shared-intermediate", "16", "--vocab", "320"]
    assert (
        main(["make-model", str(out), "--arch", "qwen3_5_moe", "--layout", "hf", *flags, *more])
        == 0
    )
    index = load_index(out)
    assert [k.kind for k in index.spec.layer_kinds] == ["linear", "full"] * 2
    assert index.norm_offset == 1.0 and index.expert_layout(0) == "fused"
    assert index.spec.linear is not None and index.spec.linear.num_v_heads == 2
    assert index.spec.moe is not None and index.spec.moe.shared_intermediate_size == 16


def test_make_model_refuses_a_quantized_hf_layout(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="mlx layout only"):
        make_model(
            tmp_path / "q", _replace(ARGS["qwen3_5"], quantize=4, intermediate=128, layout="hf")
        )
