"""`tandem make-model --arch gpt_oss`: gpt-oss's config and weights.

The weights are made by mlx-lm's own model class (`mlx_lm.models.gpt_oss`), randomly
initialised from `seed`, with the RMSNorm weights drawn as 1 + 0.1·N(0, 1) and the attention
sinks as N(0, 1) (mlx-lm starts them at zero and ones, which would hide a missed norm or sink).
`router_bias` B > 0 adds B to the router bias of experts 0..top_k-1, so a short prompt uses few
experts. Two layouts:

- "mlx": as mlx-lm saves it: experts stacked per projection, `mlp.experts.{gate,up,down}_proj`
  `.weight` [E, out, in] and `.bias`, in float;
- "hf": as OpenAI ships gpt-oss: the experts in MXFP4, `mlp.experts.gate_up_proj_blocks`
  [E, 2I, H/32, 16] uint8 (gate and up rows interleaved: row 2j is gate j, 2j + 1 up j),
  `gate_up_proj_scales` [E, 2I, H/32] uint8 (e8m0), `gate_up_proj_bias` [E, 2I], the same for
  `down_proj` ([E, H, I/32, 16]); `quantization_config: {quant_method: mxfp4}`; the rest float.

The tokenizer speaks Harmony (`factory_harmony.py`). mlx is imported inside functions only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tandem.nodes.model.factory_keys import DecoderArgs, decoder_keys

if TYPE_CHECKING:
    import mlx.core as mx

ARCH = "gpt_oss"
_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


class GptOssArgs(DecoderArgs, Protocol):
    """The fields of `factory.MakeModelArgs` read here."""

    dtype: str
    seed: int
    shards: int
    tie_embeddings: bool
    rope_theta: float | None
    rope_scaling: str
    experts: int
    top_k: int
    moe_intermediate: int
    router_bias: float
    sliding_window: int
    layout: str


def gpt_oss_config(a: GptOssArgs, head_dim: int, eos: list[int], bos: int) -> dict[str, Any]:
    """config.json as OpenAI's checkpoints write it (every key mlx-lm's ModelArgs reads)."""
    config: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": ARCH,
        **decoder_keys(a, head_dim),
        "intermediate_size": a.moe_intermediate,  # each expert's width
        "rms_norm_eps": 1e-5,
        "num_local_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "experts_per_token": a.top_k,
        "sliding_window": a.sliding_window,
        "layer_types": ["sliding_attention", "full_attention"] * (a.layers // 2),
        "rope_theta": a.rope_theta or 150000.0,
        "rope_scaling": None,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": a.dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    if a.rope_scaling == "yarn":  # the released models' (their context: 4096 × 32)
        config["rope_scaling"] = {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": False,
        }  # fmt: skip
    if a.layout == "hf":
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": _NOT_CONVERTED,
        }
    return config


def gpt_oss_problem(a: GptOssArgs, head_dim: int) -> str | None:
    """Why no gpt-oss model can be made from these arguments, or None."""
    if a.layers < 2 or a.layers % 2:
        return "gpt_oss alternates sliding and full layers: --layers must be even"
    if a.experts < 1 or not 1 <= a.top_k <= a.experts or a.moe_intermediate < 1:
        return "--experts and --moe-intermediate positive; --top-k in 1..experts"
    if a.layout not in ("mlx", "hf") or a.shards != 1 or a.tie_embeddings:
        return "gpt_oss is written untied, as one file, in --layout mlx or hf"
    if a.rope_scaling not in ("none", "yarn"):
        return "gpt_oss takes --rope-scaling none or yarn"
    if a.layout == "hf" and (a.hidden % 32 or a.moe_intermediate % 32):
        return "--layout hf stores MXFP4 experts: --hidden and --moe-intermediate in groups of 32"
    if head_dim % 2 or a.sliding_window < 1:
        return "gpt_oss needs an even head dim and a positive --sliding-window"
    return None


def write_gpt_oss(out: Path, a: GptOssArgs, head_dim: int) -> None:
    """The tokenizer, generation config, `config.json` and `model.safetensors` in `a.layout`."""
    import mlx.core as mx
    from tandem.nodes.model.factory_harmony import HARMONY_EOS_TOKENS, write_harmony_tokenizer

    bos, _, _ = write_harmony_tokenizer(out, a.vocab, a.max_position_embeddings)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    eos = [vocab[t] for t in HARMONY_EOS_TOKENS]  # <|return|>, a tool call, <|endoftext|>
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}) + "\n"
    )
    config = gpt_oss_config(a, head_dim, eos, bos)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = _mlx_weights(a, config)
    meta = {"format": "mlx"}
    if a.layout == "hf":
        weights, meta = _hf_layout(weights, a.layers), {"format": "pt"}
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=meta)


def _mlx_weights(a: GptOssArgs, config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-lm's randomly initialised model's parameters (mlx names), norms and sinks redrawn,
    the router bias raised for experts 0..top_k-1 by `a.router_bias`, cast to `a.dtype`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gpt_oss

    mx.random.seed(a.seed)
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    dtype = getattr(mx, a.dtype)
    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * mx.random.normal(value.shape)
        elif name.endswith("sinks"):
            value = mx.random.normal(value.shape)
        elif name.endswith("mlp.router.bias") and a.router_bias:
            value = value + mx.array([a.router_bias] * a.top_k + [0.0] * (a.experts - a.top_k))
        weights[name] = value.astype(dtype)
    mx.eval(weights)
    return weights


def _hf_layout(weights: dict[str, mx.array], layers: int) -> dict[str, mx.array]:
    """The same model with its experts as OpenAI stores them (see the module docstring): the
    float experts quantized to MXFP4 by mlx (`mx.quantize`), gate and up interleaved."""
    import mlx.core as mx

    out = dict(weights)
    for i in range(layers):
        p = f"model.layers.{i}.mlp.experts."
        gate, up = out.pop(p + "gate_proj.weight"), out.pop(p + "up_proj.weight")  # [E, I, H]
        gate_up = mx.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])
        bias = mx.stack([out.pop(p + "gate_proj.bias"), out.pop(p + "up_proj.bias")], axis=2)
        out[p + "gate_up_proj_bias"] = bias.reshape(gate.shape[0], -1)  # [E, 2I]
        out[p + "down_proj_bias"] = out.pop(p + "down_proj.bias")  # [E, H]
        for name, w in (("gate_up_proj", gate_up), ("down_proj", out.pop(p + "down_proj.weight"))):
            experts, rows, cols = w.shape
            words, scales = mx.quantize(w.reshape(-1, cols).astype(mx.float32), mode="mxfp4")
            blocks = words.view(mx.uint8).reshape(experts, rows, cols // 32, 16)
            out[p + name + "_blocks"] = blocks
            out[p + name + "_scales"] = scales.reshape(experts, rows, cols // 32)
    mx.eval(out)
    return out
