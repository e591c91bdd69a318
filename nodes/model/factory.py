"""`tandem make-model`: tiny random-weight HF-format models for tests and the demo.

Every file is a pure function of the arguments: same arguments, byte-identical files. Weights
come from numpy's PCG64 generator; the byte-level BPE tokenizer is trained with `tokenizers`
on `assets/corpus.txt`. The config writes `tie_word_embeddings` and `rope_theta` explicitly
(at the top level and in `rope_parameters`) so neither mlx-lm nor transformers guesses.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np
from tandem.nodes.model import factory_deepseek, factory_glm4
from tandem.nodes.model import factory_gpt_oss as gpt_oss
from tandem.nodes.model import factory_qwen3_5 as qwen3_5
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.factory_keys import decoder_keys
from tandem.nodes.model.factory_moe import (
    ExpertLayout,
    expert_weights,
    moe_config,
    moe_problem,
    shared_direction,
    sparse_layers,
)
from tandem.nodes.model.factory_tokenizer import train_tokenizer
from tandem.nodes.model.safetensors_format import RawTensor, encode, float_bytes

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
Arch = Literal[
    "llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
    "gpt_oss", "glm4_moe", "deepseek_v3",
]  # fmt: skip
ARCHS: tuple[Arch, ...] = get_args(Arch)
_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_MODEL_TYPE = {"gemma3": "gemma3_text"}  # where it is not the arch's name


@dataclass(frozen=True)
class MakeModelArgs:
    arch: Arch = "llama"
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None
    intermediate: int = 176
    vocab: int = 512
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    shards: int = 1
    seed: int = 0
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"
    rope_theta: float | None = None  # None: the family's (1e4; Gemma 3's global layers 1e6)
    tie_embeddings: bool = False  # Gemma 3 ties always (mlx-lm ties where lm_head is absent)
    max_position_embeddings: int = 4096
    quantize: int | None = None  # bits: an MLX quantized checkpoint, through mlx-lm's converter
    group_size: int = 64
    recipe: str | None = None  # mlx-lm's mixed recipes, e.g. "mixed_3_6"
    sliding_window: int = 8  # Gemma 3: positions a sliding layer attends to
    sliding_window_pattern: int = 3  # Gemma 3: every pattern-th layer is global
    rope_local_theta: float = 10000.0  # Gemma 3: the sliding layers' RoPE base
    # Qwen3-MoE (factory_moe.py): experts per routed layer, each `moe_intermediate` wide
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 64
    decoder_sparse_step: int = 1  # layer i routes where (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here (dense MLP)
    norm_topk_prob: bool = True
    expert_layout: ExpertLayout = "stacked"
    router_bias: float = 0.0  # > 0: experts 0..top_k-1 take most tokens (factory_moe.py)
    layout: qwen3_5.Layout = "mlx"  # Qwen3.5 (factory_qwen3_5.py): mlx-lm's names or HF's
    full_attention_interval: int = 4  # layer i is full attention where (i + 1) % this == 0
    linear_k_heads: int = 2
    linear_v_heads: int = 4
    linear_k_dim: int = 32
    linear_v_dim: int = 32
    conv_kernel: int = 4
    shared_intermediate: int = 64  # Qwen3.5-MoE's shared expert's width
    # mlx's quantization mode (quant.py): mxfp4, mxfp8 and nvfp4 fix the bits and group size
    q_mode: str = "affine"
    # the DeepSeek-V3 lineage (GLM-4.x MoE, DeepSeek V3): noaux_tc routing, shared experts
    first_dense: int = 1  # first_k_dense_replace: layers 0..this-1 keep a dense MLP
    n_group: int = 1  # experts in groups; a token chooses within its best topk_group groups
    topk_group: int = 1
    shared_experts: int = 1  # n_shared_experts, each moe_intermediate wide
    routed_scaling: float = 1.0  # routed_scaling_factor
    partial_rotary: float = 0.5  # GLM-4.x: RoPE turns this share of head_dim
    qk_norm: bool = False  # GLM-4.x: use_qk_norm
    kv_lora_rank: int = 32  # DeepSeek V3 (MLA): the latent's width
    q_lora_rank: int = 48  # 0: q_proj whole, no low-rank q_a/q_b
    rope_head_dim: int = 16  # qk_rope_head_dim: the shared roped key's width
    nope_head_dim: int = 32  # qk_nope_head_dim
    v_head_dim: int = 32


def _weights(a: MakeModelArgs, head_dim: int) -> Iterator[tuple[str, np.ndarray]]:
    """Random weights in a fixed order, scaled so logits are well separated (no near-ties).
    Gemma 3 norms scale by (1 + weight): theirs are the others' less one."""
    rng = np.random.default_rng(a.seed)
    h, inter = a.hidden, a.intermediate
    q_out, kv_out = a.heads * head_dim, a.kv_heads * head_dim
    gemma = a.arch == "gemma3"
    sparse, u = sparse_layers(a), shared_direction(a)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale / cols**0.5)

    def norm(n: int) -> np.ndarray:
        w = 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
        return w - np.float32(1.0) if gemma else w

    embed = rng.standard_normal((a.vocab, h), dtype=np.float32)  # [V, H]
    yield "model.embed_tokens.weight", embed if u is None else embed + u
    for i in range(a.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        yield p + "self_attn.q_proj.weight", mat(q_out, h)
        yield p + "self_attn.k_proj.weight", mat(kv_out, h)
        yield p + "self_attn.v_proj.weight", mat(kv_out, h)
        if a.arch == "qwen2":
            yield p + "self_attn.q_proj.bias", 0.1 * rng.standard_normal(q_out, dtype=np.float32)
            yield p + "self_attn.k_proj.bias", 0.1 * rng.standard_normal(kv_out, dtype=np.float32)
            yield p + "self_attn.v_proj.bias", 0.1 * rng.standard_normal(kv_out, dtype=np.float32)
        if a.arch in ("qwen3", "gemma3", "qwen3_moe"):
            yield p + "self_attn.q_norm.weight", norm(head_dim)
            yield p + "self_attn.k_norm.weight", norm(head_dim)
        yield p + "self_attn.o_proj.weight", mat(h, q_out)
        yield p + "post_attention_layernorm.weight", norm(h)
        if gemma:
            yield p + "pre_feedforward_layernorm.weight", norm(h)
        if sparse[i]:
            yield from expert_weights(mat, p, a, u)
        else:
            yield p + "mlp.gate_proj.weight", mat(inter, h)
            yield p + "mlp.up_proj.weight", mat(inter, h)
            yield p + "mlp.down_proj.weight", mat(h, inter)
        if gemma:
            yield p + "post_feedforward_layernorm.weight", norm(h)
    yield "model.norm.weight", norm(h)
    if not _tied(a):
        yield "lm_head.weight", mat(a.vocab, h, scale=3.0)


def _tied(a: MakeModelArgs) -> bool:
    return a.tie_embeddings or a.arch == "gemma3"


def _rope_theta(a: MakeModelArgs) -> float:
    if a.rope_theta is not None:
        return a.rope_theta
    return 1_000_000.0 if a.arch == "gemma3" else 10000.0


def _shard_of(name: str, a: MakeModelArgs) -> int:
    """Layers split evenly over the shards; the embedding first, the head last."""
    if name.startswith("model.layers."):
        i = int(name.split(".")[2])
        return min(i * a.shards // a.layers, a.shards - 1)
    return 0 if name.startswith("model.embed") else a.shards - 1


def _config(a: MakeModelArgs, head_dim: int, eos: int, bos: int) -> dict[str, object]:
    theta = _rope_theta(a)
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": theta}
    scaling: dict[str, object] | None = None
    if a.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        rope = {**scaling, "rope_theta": theta}
    config: dict[str, object] = {
        "architectures": [_ARCH[a.arch]],
        "model_type": _MODEL_TYPE.get(a.arch, a.arch),
        **decoder_keys(a, head_dim),
        "rope_theta": theta,
        "rope_parameters": rope,
        "tie_word_embeddings": _tied(a),
        "torch_dtype": a.dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "attention_bias": a.arch == "qwen2",
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if scaling is not None:
        config["rope_scaling"] = scaling
    config.update(moe_config(a))
    if a.arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = a.layers
    if a.arch == "mistral":
        config["sliding_window"] = None
    if a.arch == "gemma3":
        config.update(_gemma3_config(a, head_dim, theta))
    return config


def _gemma3_config(a: MakeModelArgs, head_dim: int, theta: float) -> dict[str, object]:
    """Gemma 3's keys, in the forms both transformers 4 (top-level thetas) and 5 (per layer
    type `rope_parameters`, `layer_types`) read; mlx-lm reads the top-level ones."""
    pattern = a.sliding_window_pattern
    kinds = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(a.layers)
    ]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": a.rope_local_theta,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": a.rope_local_theta},
        },
        "rope_scaling": None,
        "sliding_window": a.sliding_window,
        "sliding_window_pattern": pattern,
        "layer_types": kinds,
        # not head_dim, so a scale of head_dim ** -0.5 would show (27B's is not either)
        "query_pre_attn_scalar": 2 * head_dim,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _train_tokenizer(vocab: int) -> str:
    """Byte-level BPE on the committed corpus; returns tokenizer.json text."""
    return train_tokenizer(vocab, SPECIAL_TOKENS)


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def make_model(out_dir: str | Path, args: MakeModelArgs, with_tokenizer: bool = True) -> Path:
    """Write a complete HF-format model directory and return its path.

    `with_tokenizer=False` skips the tokenizer (and the `tokenizers` import): enough for the
    prefill bench on a bare GPU box, which feeds token ids directly. `args.quantize` writes
    the same model as an MLX quantized checkpoint instead (`quantize_model`).
    """
    if args.quantize is not None or args.recipe is not None:
        from tandem.nodes.model.factory_quantize import quantize_model

        return quantize_model(out_dir, args)
    _check(args)
    head_dim = args.head_dim or args.hidden // args.heads
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.arch == gpt_oss.ARCH:  # its own tokenizer (Harmony) and weights
        gpt_oss.write_gpt_oss(out, args, head_dim)
        return out

    bos, eos, im_end = 1, 0, 2  # the special tokens' ids in the trained vocabulary
    if with_tokenizer:
        bos, eos, im_end = _write_tokenizer(out, args)
    (out / "generation_config.json").write_text(
        _dump({"bos_token_id": bos, "eos_token_id": [im_end, eos], "do_sample": False})
    )
    if args.arch in ("glm4_moe", "deepseek_v3"):  # mlx-lm's own classes make the weights
        writer = factory_glm4.write_glm4 if args.arch == "glm4_moe" else factory_deepseek.write
        writer(out, args, head_dim, im_end, bos)
        return out
    if args.arch in qwen3_5.ARCHS:
        qwen3_5.write_qwen3_5(out, args, head_dim, im_end, bos)
        return out
    (out / "config.json").write_text(_dump(_config(args, head_dim, im_end, bos)))
    _write_weights(out, args, head_dim)
    return out


def _check(args: MakeModelArgs) -> None:
    """Refuse arguments no float model can be made from (ModelError)."""
    if args.arch not in ARCHS:
        raise ModelError(f"unsupported architecture {args.arch!r}; choose from {ARCHS}")
    if args.arch == "gemma3" and (args.sliding_window < 1 or args.sliding_window_pattern < 1):
        raise ModelError("--sliding-window and --sliding-window-pattern must be positive")
    if args.vocab < 300:
        raise ModelError("--vocab must be at least 300 (256 byte tokens plus merges and specials)")
    if args.heads % args.kv_heads or args.shards < 1 or args.shards > args.layers:
        raise ModelError("--heads must be a multiple of --kv-heads and 1 <= --shards <= --layers")
    problem = moe_problem(args) or qwen3_5.qwen3_5_problem(args)
    if args.arch == gpt_oss.ARCH:
        problem = gpt_oss.gpt_oss_problem(args, args.head_dim or args.hidden // args.heads)
    if args.arch == factory_deepseek.ARCH:
        problem = factory_deepseek.deepseek_problem(args)
    if args.arch == factory_glm4.ARCH:
        problem = factory_glm4.glm4_problem(args, args.head_dim or args.hidden // args.heads)
    if problem is not None:
        raise ModelError(problem)


def _write_tokenizer(out: Path, args: MakeModelArgs) -> tuple[int, int, int]:
    """Train and write the tokenizer and its config; the ids of (bos, eos, im_end)."""
    tokenizer_json = _train_tokenizer(args.vocab)
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    bos, eos, im_end = vocab["<|im_start|>"], vocab["<|endoftext|>"], vocab["<|im_end|>"]
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(
        _dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": args.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return bos, eos, im_end


def _write_weights(out: Path, args: MakeModelArgs, head_dim: int) -> None:
    """The weights as `args.shards` safetensors files (with an index when more than one),
    replacing any left from an earlier model in `out`."""
    shards: list[dict[str, RawTensor]] = [{} for _ in range(args.shards)]
    for name, array in _weights(args, head_dim):
        dtype, data = float_bytes(array, args.dtype)
        shards[_shard_of(name, args)][name] = RawTensor(dtype, tuple(array.shape), data)
    meta = {"format": "pt"}
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    if args.shards == 1:
        (out / "model.safetensors").write_bytes(encode(shards[0], meta))
        return
    weight_map: dict[str, str] = {}
    total = 0
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
        (out / fname).write_bytes(encode(tensors, meta))
        weight_map.update({name: fname for name in tensors})
        total += sum(len(t.data) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(_dump(index))


def replace_dir(done: Path, final: Path) -> None:
    """Move a finished directory into place (a half-written one never has the final name)."""
    if final.exists():
        shutil.rmtree(final)
    done.rename(final)
