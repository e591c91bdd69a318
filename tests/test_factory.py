"""`make-model`: deterministic tiny models that mlx-lm and transformers load and agree on."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from tandem.nodes.model import ModelError, load_index, load_spec
from tandem.nodes.model.factory import CHAT_TEMPLATE, MakeModelArgs, make_model

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
transformers = pytest.importorskip("transformers")

MakeTiny = Callable[..., Path]  # the `tiny_model` fixture (tests/conftest.py)
PROMPT_IDS = [(7 * i + 3) % 500 for i in range(96)]  # long enough for RoPE to matter


def _files(model: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(model.iterdir())}


def _mlx_logits(model: Path) -> np.ndarray:
    net, _ = mlx_lm.load(str(model))
    logits = net(mx.array([PROMPT_IDS]))
    return np.array(logits.astype(mx.float32))  # [1, T, V]


def _hf_logits(model: Path) -> np.ndarray:
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return net(torch.tensor([PROMPT_IDS])).logits.numpy()  # [1, T, V]


# --- determinism and arguments -------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"arch": "qwen2", "shards": 2}, {"dtype": "bfloat16"}])
def test_same_arguments_same_bytes(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    args = MakeModelArgs(**kwargs)
    a = _files(make_model(tmp_path / "a", args))
    b = _files(make_model(tmp_path / "b", args))
    assert "config.json" in a
    assert "tokenizer.json" in a
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def test_different_seed_different_weights(tmp_path: Path) -> None:
    a = _files(make_model(tmp_path / "a", MakeModelArgs(seed=0)))
    b = _files(make_model(tmp_path / "b", MakeModelArgs(seed=1)))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]  # the tokenizer depends on vocab only
    wa, wb = (
        load_file(tmp_path / "a/model.safetensors"),
        load_file(tmp_path / "b/model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].shape == wb[name].shape
        assert not np.array_equal(wa[name], wb[name]), name


def test_remake_with_fewer_shards_drops_stale_files(tmp_path: Path) -> None:
    out = tmp_path / "m"
    make_model(out, MakeModelArgs(shards=2))
    make_model(out, MakeModelArgs(shards=1))
    assert sorted(f.name for f in out.glob("model*")) == ["model.safetensors"]
    assert [f.name for f in load_index(out).files] == ["model.safetensors"]


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"arch": "gpt2"}, "unsupported architecture"),
        ({"vocab": 200}, "--vocab"),
        ({"heads": 4, "kv_heads": 3}, "--kv-heads"),
        ({"shards": 5}, "--shards"),
        ({"shards": 0}, "--shards"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(ModelError, match=why):
        make_model(tmp_path / "m", MakeModelArgs(**kwargs))
    assert not (tmp_path / "m").exists()


def test_config_writes_the_trap_keys(tiny_model: MakeTiny) -> None:
    config = json.loads((tiny_model(rope_theta=50000.0) / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 50000.0
    assert config["rope_parameters"]["rope_theta"] == 50000.0


def test_head_dim_override(tiny_model: MakeTiny) -> None:
    spec = load_index(tiny_model(arch="qwen3", hidden=64, heads=4, head_dim=32)).spec
    assert spec.head_dim == 32


# --- bf16 ----------------------------------------------------------------------------------


def test_bf16_is_float32_rounded_to_nearest_even(tiny_model: MakeTiny) -> None:
    f32 = load_index(tiny_model(seed=3))
    bf16 = load_index(tiny_model(seed=3, dtype="bfloat16"))
    assert bf16.dtype == "BF16"
    arrays = load_file(f32.files[0])
    for layer_f32, layer_bf16 in zip(f32.layers, bf16.layers, strict=True):
        for short, e in layer_bf16.items():
            with open(e.file, "rb") as f:
                f.seek(e.offset)
                got = f.read(e.nbytes)
            want = torch.from_numpy(arrays[layer_f32[short].name]).to(torch.bfloat16)
            assert got == want.view(torch.uint16).numpy().tobytes(), short


def test_bf16_model_loads(tiny_model: MakeTiny) -> None:
    model = tiny_model(arch="qwen2", dtype="bfloat16")
    assert load_spec(model).torch_dtype == "bfloat16"
    net, _ = mlx_lm.load(str(model))
    logits = net(mx.array([PROMPT_IDS[:8]]))
    assert logits.dtype == mx.bfloat16
    assert logits.shape == (1, 8, 512)
    assert bool(mx.all(mx.isfinite(logits.astype(mx.float32))))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model)
    assert hf.dtype == torch.bfloat16


# --- mlx-lm and transformers ---------------------------------------------------------------


def test_mlx_lm_generates(tiny_model: MakeTiny) -> None:
    net, tokenizer = mlx_lm.load(str(tiny_model(arch="qwen3")))
    text = mlx_lm.generate(net, tokenizer, "the cat sat on the", max_tokens=8)
    assert isinstance(text, str)
    assert text != ""


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "llama", "rope_scaling": "llama3"},
        {"arch": "mistral"},
        {"arch": "qwen2"},
        {"arch": "qwen3", "tie_embeddings": True},
    ],
    ids=["llama-llama3", "mistral", "qwen2", "qwen3-tied"],
)
def test_mlx_lm_logits_equal_transformers(tiny_model: MakeTiny, kwargs: dict[str, Any]) -> None:
    model = tiny_model(**kwargs)
    mlx_logits, hf_logits = _mlx_logits(model), _hf_logits(model)
    assert mlx_logits.shape == hf_logits.shape == (1, len(PROMPT_IDS), 512)
    assert np.abs(hf_logits).max() > 1.0  # not a degenerate all-zero model
    np.testing.assert_allclose(mlx_logits, hf_logits, rtol=0, atol=1e-4)


def test_llama3_scaling_changes_logits(tiny_model: MakeTiny) -> None:
    # guards the comparison above: the scaling must reach both frameworks' RoPE
    plain, scaled = tiny_model(arch="llama"), tiny_model(arch="llama", rope_scaling="llama3")
    assert np.abs(_hf_logits(plain) - _hf_logits(scaled)).max() > 1e-3
    assert np.abs(_mlx_logits(plain) - _mlx_logits(scaled)).max() > 1e-3


def test_tied_model_uses_the_embedding_as_head(tiny_model: MakeTiny) -> None:
    model = tiny_model(arch="qwen3", tie_embeddings=True)
    assert "lm_head.weight" not in load_file(model / "model.safetensors")
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()


# --- tokenizer and generation config -------------------------------------------------------


def test_chat_template_applies(tiny_model: MakeTiny) -> None:
    model = tiny_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start
    assert ids.count(im_start) == 2  # special tokens stay single ids
    assert tokenizer.decode(ids) == text
    _, mlx_tokenizer = mlx_lm.load(str(model))
    assert mlx_tokenizer.encode(text, add_special_tokens=False) == ids


def test_tokenizer_fits_the_embedding(tiny_model: MakeTiny) -> None:
    model = tiny_model(vocab=384)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    assert 300 <= len(tokenizer) <= 384
    assert max(tokenizer.encode("Hello, tandem! ünïcödé 123")) < 384


def test_generation_config_eos_ids(tiny_model: MakeTiny) -> None:
    model = tiny_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == im_end
    generation = transformers.GenerationConfig.from_pretrained(model)
    assert generation.eos_token_id == [im_end, eot]
    assert load_spec(model).eos_token_ids == (im_end, eot)
    _, mlx_tokenizer = mlx_lm.load(str(model))
    assert set(mlx_tokenizer.eos_token_ids) == {im_end, eot}


def test_make_model_command_writes_gemma3(tmp_path: Path) -> None:
    from tandem.app.cli.main import main

    args = ["--sliding-window", "16", "--sliding-window-pattern", "2", "--layers", "4"]
    assert main(["make-model", str(tmp_path / "g"), "--arch", "gemma3", *args]) == 0
    spec = load_spec(tmp_path / "g")
    assert spec.family == "gemma3_text"
    assert [k.kind for k in spec.layer_kinds] == ["sliding", "full"] * 2
    assert {k.window for k in spec.layer_kinds if k.kind == "sliding"} == {16}
    llama = tmp_path / "l"
    assert main(["make-model", str(llama)]) == 0
    assert json.loads((llama / "config.json").read_text())["rope_theta"] == 10000.0
