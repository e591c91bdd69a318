"""`load_spec` on Gemma 3 (`gemma3_text`): its layer kinds and two RoPE bases, both config
forms (transformers 5's `rope_parameters` per layer type, and the bare one), and the configs
mlx-lm would read otherwise, refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tandem.nodes.model import load_index, load_spec
from tandem.nodes.model.index import expected_layer_shapes

from tests.test_model_spec import GLOBALS, MakeTiny, _copy, _edit_config, _raises_naming


def test_gemma3_spec(tiny_model: MakeTiny) -> None:
    model = tiny_model(arch="gemma3", layers=6, sliding_window=8, sliding_window_pattern=3)
    spec = load_spec(model)
    assert spec.family == "gemma3_text"
    kinds = [(k.kind, k.window) for k in spec.layer_kinds]
    assert kinds == [("sliding", 8), ("sliding", 8), ("full", None)] * 2
    assert (spec.rope_theta, spec.rope_local_theta) == (1e6, 1e4)
    assert spec.query_pre_attn_scalar == 2 * spec.head_dim
    assert spec.qk_norm and spec.post_norms and spec.tie_word_embeddings
    assert spec.hidden_act == "gelu_pytorch_tanh"
    index = load_index(model)
    assert {k: e.shape for k, e in index.layers[0].items()} == expected_layer_shapes(spec)
    assert "pre_feedforward_layernorm.weight" in index.layers[0]
    assert set(index.globals) == GLOBALS - {"lm_head.weight"}


def _transformers5(config: dict[str, Any]) -> None:
    """The config as transformers 5 writes it: per-type thetas, `rope_theta: null`."""
    for key in ("rope_theta", "rope_local_base_freq", "sliding_window_pattern"):
        config.pop(key)
    config["rope_theta"] = None
    config["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    config["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }


def test_gemma3_transformers5_config(tiny_model: MakeTiny, tmp_path: Path) -> None:
    # mlx-lm's defaults (pattern 6, thetas 1e6 / 1e4) stand in for what is missing or null
    model = _copy(tiny_model(arch="gemma3", layers=6), tmp_path)
    _edit_config(model, _transformers5)
    spec = load_spec(model)
    assert [k.kind for k in spec.layer_kinds] == ["sliding"] * 5 + ["full"]
    assert (spec.rope_theta, spec.rope_local_theta) == (1e6, 1e4)


def test_gemma3_architecture_and_defaults(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(arch="gemma3", layers=6), tmp_path)

    def bare(config: dict[str, Any]) -> None:
        for key in ("model_type", "head_dim", "query_pre_attn_scalar", "sliding_window",
                    "tie_word_embeddings", "layer_types", "rope_parameters"):  # fmt: skip
            config.pop(key)

    _edit_config(model, bare)
    spec = load_spec(model)
    assert spec.family == "gemma3_text" and spec.tie_word_embeddings
    assert (spec.head_dim, spec.query_pre_attn_scalar) == (256, 256.0)
    assert spec.layer_kinds[0].window == 512


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"layer_types": ["full_attention"] * 6}, ("layer_types", "sliding_window_pattern")),
        ({"layer_types": ["sliding"] * 6}, ("layer_types",)),
        (
            {"rope_parameters": {"sliding_attention": {"rope_theta": 5e4}}},
            ("sliding_attention", "rope_local_base_freq"),
        ),
    ],
)
def test_gemma3_configs_mlx_lm_reads_otherwise_are_refused(
    tiny_model: MakeTiny, tmp_path: Path, edit: dict[str, Any], words: tuple[str, ...]
) -> None:
    model = _copy(tiny_model(arch="gemma3", layers=6), tmp_path)
    _edit_config(model, lambda config: config.update(edit))
    _raises_naming(model / "config.json", *words)(lambda: load_spec(model))
