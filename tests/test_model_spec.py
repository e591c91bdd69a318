"""`load_spec` and `load_index` over the dense families, and the errors a bad directory raises
(Gemma 3: tests/test_gemma3_spec.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.numpy import load_file
from tandem.nodes.model import ModelError, RopeScaling, load_index, load_spec
from tandem.nodes.model.index import expected_layer_shapes
from tandem.nodes.model.safetensors_format import RawTensor, encode, read_header

MakeTiny = Callable[..., Path]  # the `tiny_model` fixture (tests/conftest.py)
GLOBALS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def _copy(model: Path, tmp_path: Path) -> Path:
    """A private copy of a session model, safe to mutate."""
    return Path(shutil.copytree(model, tmp_path / model.name))


def _edit_config(model: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = model / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _rewrite_shard(shard: Path, change: Callable[[dict[str, RawTensor]], None]) -> None:
    """Re-encode a shard after `change` edits its tensors (name → RawTensor) in place."""
    raw = shard.read_bytes()
    with open(shard, "rb") as f:
        entries, metadata, start = read_header(f)
    tensors = {
        name: RawTensor(e.dtype, e.shape, raw[start + e.begin : start + e.end])
        for name, e in entries.items()
    }
    change(tensors)
    shard.write_bytes(encode(tensors, metadata))


# --- families ------------------------------------------------------------------------------


def test_llama_with_llama3_rope_scaling(tiny_model: MakeTiny) -> None:
    spec = load_spec(tiny_model(arch="llama", rope_scaling="llama3", rope_theta=500000.0))
    assert spec.family == "llama"
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=1024,
    )
    assert not spec.attention_bias
    assert not spec.qk_norm


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_spec_fields(tiny_model: MakeTiny, arch: str) -> None:
    model = tiny_model(arch=arch, layers=3, hidden=96, heads=6, kv_heads=2, intermediate=160)
    spec = load_spec(model)
    assert spec.path == model
    assert spec.family == arch
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (3, 96, 6, 2)
    assert (spec.head_dim, spec.intermediate_size, spec.vocab_size) == (16, 160, 512)
    assert spec.rope_theta == 10000.0
    assert spec.rope_scaling is None
    assert spec.rms_norm_eps == 1e-6
    assert spec.torch_dtype == "float32"
    assert spec.tie_word_embeddings is False
    assert spec.attention_bias is (arch == "qwen2")
    assert spec.qk_norm is (arch == "qwen3")
    assert spec.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_index_holds_each_layers_tensors(tiny_model: MakeTiny, arch: str) -> None:
    index = load_index(tiny_model(arch=arch))
    expected = expected_layer_shapes(index.spec)
    assert len(index.layers) == 4
    for layer in index.layers:
        assert {k: e.shape for k, e in layer.items()} == expected
    assert set(index.globals) == GLOBALS
    assert index.dtype == "F32"
    has_bias = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    has_qk_norm = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    assert (has_bias <= expected.keys()) is (arch == "qwen2")
    assert (has_qk_norm <= expected.keys()) is (arch == "qwen3")
    if arch == "qwen3":
        assert index.layers[0]["self_attn.q_norm.weight"].shape == (index.spec.head_dim,)
    if arch == "qwen2":
        assert index.layers[0]["self_attn.k_proj.bias"].shape == (2 * index.spec.head_dim,)


def test_bf16_index(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(arch="qwen3", dtype="bfloat16"))
    assert index.dtype == "BF16"
    assert index.spec.torch_dtype == "bfloat16"
    assert index.spec.kv_bytes_per_token == 2 * 4 * 2 * 16 * 2
    q = index.layers[0]["self_attn.q_proj.weight"]
    assert q.itemsize == 2
    assert q.nbytes == 64 * 64 * 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_index_points_at_each_tensors_bytes(tiny_model: MakeTiny, arch: str) -> None:
    model = tiny_model(arch=arch, shards=2)
    index = load_index(model)
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(index.files) == 2
    assert {f.name for f in index.files} == set(weight_map.values())
    loaded = {f: load_file(f) for f in index.files}
    entries = list(index.globals.values()) + [e for layer in index.layers for e in layer.values()]
    assert {e.name for e in entries} == set(weight_map)
    for e in entries:
        assert e.file.name == weight_map[e.name]
        with open(e.file, "rb") as f:
            f.seek(e.offset)
            data = f.read(e.nbytes)
        array = loaded[e.file][e.name]
        assert e.shape == array.shape
        assert e.nbytes == array.nbytes
        assert data == array.tobytes(), e.name
    # layers split over both shards: the first layer in the first, the last in the second
    assert index.layers[0]["mlp.up_proj.weight"].file.name.startswith("model-00001")
    assert index.layers[-1]["mlp.up_proj.weight"].file.name.startswith("model-00002")
    assert index.total_bytes == sum(a.nbytes for t in loaded.values() for a in t.values())
    assert index.layer_bytes(0) == sum(e.nbytes for e in index.layers[0].values())


# --- config traps --------------------------------------------------------------------------


def test_rope_theta_only_in_rope_parameters(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(arch="llama"), tmp_path)

    def edit(config: dict[str, Any]) -> None:
        del config["rope_theta"]
        config["rope_parameters"]["rope_theta"] = 250000.0

    _edit_config(model, edit)
    spec = load_spec(model)
    assert spec.rope_theta == 250000.0
    assert spec.rope_scaling is None


def test_rope_theta_at_top_level_only(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(arch="qwen3"), tmp_path)

    def edit(config: dict[str, Any]) -> None:
        del config["rope_parameters"]
        config["rope_theta"] = 1000000.0

    _edit_config(model, edit)
    assert load_spec(model).rope_theta == 1000000.0


def test_llama3_scaling_only_in_rope_parameters(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(arch="llama", rope_scaling="llama3"), tmp_path)

    def edit(config: dict[str, Any]) -> None:
        del config["rope_scaling"]
        del config["rope_theta"]
        config["rope_parameters"]["rope_theta"] = 500000.0

    _edit_config(model, edit)
    spec = load_spec(model)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling is not None
    assert (spec.rope_scaling.kind, spec.rope_scaling.factor) == ("llama3", 8.0)


def test_tie_word_embeddings_explicit(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(arch="qwen3", tie_embeddings=True))
    assert index.spec.tie_word_embeddings is True
    assert "lm_head.weight" not in index.globals


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tie_word_embeddings_default(tiny_model: MakeTiny, tmp_path: Path, arch: str) -> None:
    model = _copy(tiny_model(arch=arch), tmp_path)
    _edit_config(model, lambda config: config.pop("tie_word_embeddings"))
    # transformers' default for these four families: untied
    assert load_spec(model).tie_word_embeddings is False


def test_eos_ids_from_generation_config(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(arch="llama"), tmp_path)
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    im_end, eot = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    assert load_spec(model).eos_token_ids == (im_end, eot)
    (model / "generation_config.json").unlink()
    assert load_spec(model).eos_token_ids == (im_end,)  # config.json's single id


# --- bad directories -----------------------------------------------------------------------


def _raises_naming(path: Path, *fragments: str) -> Callable[[Callable[[], object]], None]:
    def check(call: Callable[[], object]) -> None:
        with pytest.raises(ModelError) as info:
            call()
        message = str(info.value)
        assert str(path) in message
        for fragment in fragments:
            assert fragment in message

    return check


def test_not_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    _raises_naming(file, "not a model directory")(lambda: load_spec(file))
    missing = tmp_path / "nowhere"
    _raises_naming(missing, "not a model directory")(lambda: load_index(missing))


def test_missing_config(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    (model / "config.json").unlink()
    _raises_naming(model / "config.json", "not found")(lambda: load_index(model))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_config_not_json_object(tiny_model: MakeTiny, tmp_path: Path, text: str) -> None:
    model = _copy(tiny_model(), tmp_path)
    (model / "config.json").write_text(text)
    _raises_naming(model / "config.json")(lambda: load_spec(model))


def test_generation_config_not_json(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    (model / "generation_config.json").write_text("eos=2")
    _raises_naming(model / "generation_config.json")(lambda: load_spec(model))


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], ["LlamaForCausalLM"]])
def test_unsupported_model_type(
    tiny_model: MakeTiny, tmp_path: Path, architectures: list[str]
) -> None:
    # mlx-lm dispatches on model_type, so a Llama-looking `architectures` must not override it
    model = _copy(tiny_model(), tmp_path)
    _edit_config(
        model, lambda config: config.update(model_type="gpt2", architectures=architectures)
    )
    _raises_naming(model / "config.json", "gpt2", "unsupported")(lambda: load_spec(model))


def test_family_from_architectures_when_model_type_absent(
    tiny_model: MakeTiny, tmp_path: Path
) -> None:
    model = _copy(tiny_model(arch="qwen2"), tmp_path)
    _edit_config(model, lambda config: config.pop("model_type"))
    assert load_spec(model).family == "qwen2"


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_config_key(tiny_model: MakeTiny, tmp_path: Path, key: str) -> None:
    model = _copy(tiny_model(), tmp_path)
    _edit_config(model, lambda config: config.pop(key))
    _raises_naming(model / "config.json", "missing key", key)(lambda: load_spec(model))


def test_malformed_config_value(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    _edit_config(model, lambda config: config.update(hidden_size="wide"))
    _raises_naming(model / "config.json", "malformed")(lambda: load_spec(model))


def test_heads_not_multiple_of_kv_heads(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    _edit_config(model, lambda config: config.update(num_key_value_heads=3))
    _raises_naming(model / "config.json", "num_key_value_heads")(lambda: load_spec(model))


def test_missing_safetensors(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    (model / "model.safetensors").unlink()
    load_spec(model)  # the spec alone needs no weights
    _raises_naming(model, "no model.safetensors")(lambda: load_index(model))


def test_index_lists_a_missing_shard(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(shards=2), tmp_path)
    shard = model / "model-00002-of-00002.safetensors"
    shard.unlink()
    _raises_naming(shard, "missing")(lambda: load_index(model))


def test_malformed_shard_index(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(shards=2), tmp_path)
    index_file = model / "model.safetensors.index.json"
    index_file.write_text('{"metadata": {}}')
    _raises_naming(index_file, "malformed")(lambda: load_index(model))


@pytest.mark.parametrize(
    ("corrupt", "why"),
    [
        (lambda raw: raw[:5], "shorter than the 8-byte header"),
        (lambda raw: raw[:200], "runs past the end"),
        (lambda raw: b"\xff" * 8 + raw[8:], "implausible"),
        (lambda raw: raw[:8] + b"garbage!" + raw[16:], "not JSON"),
    ],
    ids=["truncated-length", "truncated-header", "garbage-length", "garbage-json"],
)
def test_corrupt_header(
    tiny_model: MakeTiny,
    tmp_path: Path,
    corrupt: Callable[[bytes], bytes],
    why: str,
) -> None:
    model = _copy(tiny_model(shards=2), tmp_path)
    shard = model / "model-00001-of-00002.safetensors"
    shard.write_bytes(corrupt(shard.read_bytes()))
    _raises_naming(shard, "corrupt safetensors header", why)(lambda: load_index(model))


def test_truncated_data(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    _raises_naming(shard, "runs past the end of the file")(lambda: load_index(model))


@pytest.mark.parametrize(
    "name",
    ["model.layers.2.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.bias"],
)
def test_missing_layer_tensor(tiny_model: MakeTiny, tmp_path: Path, name: str) -> None:
    model = _copy(tiny_model(arch="qwen2"), tmp_path)
    _rewrite_shard(model / "model.safetensors", lambda tensors: tensors.pop(name))
    _raises_naming(model, f"missing tensor {name}")(lambda: load_index(model))


@pytest.mark.parametrize(
    "name", ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
)
def test_missing_global_tensor(tiny_model: MakeTiny, tmp_path: Path, name: str) -> None:
    model = _copy(tiny_model(shards=2), tmp_path)
    shard = "model-00001" if name.startswith("model.embed") else "model-00002"
    _rewrite_shard(model / f"{shard}-of-00002.safetensors", lambda tensors: tensors.pop(name))
    _raises_naming(model, f"missing tensor {name}")(lambda: load_index(model))


def test_wrong_layer_shape(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"

    def transpose(tensors: dict[str, RawTensor]) -> None:
        t = tensors[name]
        tensors[name] = RawTensor(t.dtype, t.shape[::-1], t.data)

    _rewrite_shard(model / "model.safetensors", transpose)
    _raises_naming(model / "model.safetensors", name, "(176, 64)", "(64, 176)")(
        lambda: load_index(model)
    )


def test_config_disagrees_with_embedding(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    _edit_config(model, lambda config: config.update(vocab_size=1000))
    _raises_naming(model / "model.safetensors", "model.embed_tokens.weight", "(1000, 64)")(
        lambda: load_index(model)
    )


def test_tensor_beyond_num_layers(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    _edit_config(model, lambda config: config.update(num_hidden_layers=2))
    _raises_naming(model / "model.safetensors", "model.layers.2.", "beyond")(
        lambda: load_index(model)
    )


def test_mixed_layer_dtypes(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = _copy(tiny_model(), tmp_path)
    name = "model.layers.3.mlp.up_proj.weight"

    def to_half(tensors: dict[str, RawTensor]) -> None:
        t = tensors[name]
        tensors[name] = RawTensor("F16", t.shape, bytes(len(t.data) // 2))

    _rewrite_shard(model / "model.safetensors", to_half)
    _raises_naming(model / "model.safetensors", name, "F16")(lambda: load_index(model))


# --- Gemma 3 -------------------------------------------------------------------------------
