"""`tandem make-model --arch qwen3_5 | qwen3_5_moe`: Qwen3.5's config and weights.

The weights are made by mlx-lm's own model classes (`mlx_lm.models.qwen3_5`, `qwen3_5_moe`),
randomly initialised from `seed`, with every RMSNorm weight, the gated norm and `dt_bias` drawn
as 1 + 0.1·N(0, 1) (mlx-lm initialises them to ones, which would hide a missed norm offset).
Two layouts of the same numbers:

- "mlx": as mlx-lm saves it: `language_model.model.layers.N.*`, `language_model.lm_head.weight`,
  the conv weight [C, K, 1], experts stacked (`mlp.switch_mlp.*`);
- "hf": as Hugging Face stores `Qwen3_5(Moe)ForConditionalGeneration`:
  `model.language_model.layers.N.*`, `lm_head.weight`, the conv weight [C, 1, K], the
  RMSNorm weights (not the gated norm) less one, experts fused (`mlp.experts.gate_up_proj`
  [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).

mlx is imported inside functions only (DESIGN.md layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from tandem.nodes.model.factory_keys import DecoderArgs, decoder_keys

if TYPE_CHECKING:
    import mlx.core as mx

ARCHS = ("qwen3_5", "qwen3_5_moe")
Layout = Literal["mlx", "hf"]
_ARCH = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# the norms Hugging Face stores less one (mlx-lm's `sanitize` adds it back), by mlx key suffix
_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


class Qwen35Args(DecoderArgs, Protocol):
    """The fields of `factory.MakeModelArgs` read here."""

    arch: str
    dtype: str
    seed: int
    shards: int
    tie_embeddings: bool
    rope_theta: float | None
    experts: int
    top_k: int
    moe_intermediate: int
    norm_topk_prob: bool
    layout: Layout
    full_attention_interval: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    shared_intermediate: int


def qwen3_5_config(a: Qwen35Args, head_dim: int, eos: int, bos: int) -> dict[str, object]:
    """config.json as Hugging Face writes it: the text keys nested in `text_config`."""
    interval = a.full_attention_interval
    text: dict[str, object] = {
        "model_type": f"{a.arch}_text",
        **decoder_keys(a, head_dim),
        "linear_num_key_heads": a.linear_k_heads,
        "linear_num_value_heads": a.linear_v_heads,
        "linear_key_head_dim": a.linear_k_dim,
        "linear_value_head_dim": a.linear_v_dim,
        "linear_conv_kernel_dim": a.conv_kernel,
        "full_attention_interval": interval,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(a.layers)
        ],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": a.rope_theta or 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
        "attention_bias": False,
        "tie_word_embeddings": a.tie_embeddings,
        "dtype": a.dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    if a.arch == "qwen3_5_moe":
        text.update(
            num_experts=a.experts,
            num_experts_per_tok=a.top_k,
            moe_intermediate_size=a.moe_intermediate,
            shared_expert_intermediate_size=a.shared_intermediate,
            norm_topk_prob=a.norm_topk_prob,
            decoder_sparse_step=1,
        )
    return {
        "architectures": [_ARCH[a.arch]],
        "model_type": a.arch,
        "text_config": text,
        "tie_word_embeddings": a.tie_embeddings,
        "torch_dtype": a.dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def qwen3_5_problem(a: Qwen35Args) -> str | None:
    """Why no Qwen3.5 model can be made from these arguments, or None."""
    if a.arch not in ARCHS:
        return None
    if a.layout not in ("mlx", "hf"):
        return f"--layout must be mlx or hf, not {a.layout!r}"
    if a.shards != 1:
        return f"{a.arch} is written as one safetensors file (--shards 1)"
    if a.full_attention_interval < 1 or a.conv_kernel < 2:
        return "--full-attention-interval must be positive and --conv-kernel at least 2"
    if min(a.linear_k_heads, a.linear_v_heads, a.linear_k_dim, a.linear_v_dim) < 1:
        return "--linear-k-heads, --linear-v-heads, --linear-k-dim, --linear-v-dim must be positive"
    if a.linear_v_heads % a.linear_k_heads:
        return "--linear-v-heads must be a multiple of --linear-k-heads"
    if a.arch == "qwen3_5_moe" and (
        a.experts < 1
        or not 1 <= a.top_k <= a.experts
        or min(a.moe_intermediate, a.shared_intermediate) < 1
    ):
        return "--experts, --moe-intermediate, --shared-intermediate positive; top-k in 1..experts"
    return None


def qwen3_5_widths(a: Qwen35Args, head_dim: int) -> list[int]:
    """The input widths of the linear layers mlx-lm would quantize (each must be whole groups)."""
    widths = [a.hidden, a.heads * head_dim, a.linear_v_heads * a.linear_v_dim]
    if a.arch == "qwen3_5_moe":
        return [*widths, a.moe_intermediate, a.shared_intermediate]
    return [*widths, a.intermediate]


def write_qwen3_5(out: Path, a: Qwen35Args, head_dim: int, eos: int, bos: int) -> None:
    """`out/config.json` and the weights, as `out/model.safetensors` in `a.layout`."""
    import mlx.core as mx

    config = qwen3_5_config(a, head_dim, eos, bos)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = _mlx_weights(a, config)
    meta = {"format": "mlx"}
    if a.layout == "hf":
        weights, meta = _hf_layout(weights, a.layers), {"format": "pt"}
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=meta)


def _mlx_weights(a: Qwen35Args, config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-lm's randomly initialised model's parameters (mlx names), the norms and `dt_bias`
    redrawn, cast to `a.dtype` except `A_log` (mlx-lm's cast_predicate)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{a.arch}")
    mx.random.seed(a.seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    dtype = getattr(mx, a.dtype)
    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("norm.weight", "dt_bias")):
            value = 1.0 + 0.1 * mx.random.normal(value.shape)
        weights[name] = value if name.endswith("A_log") else value.astype(dtype)
    mx.eval(weights)
    return weights


def _hf_layout(weights: dict[str, mx.array], layers: int) -> dict[str, mx.array]:
    """The same weights as Hugging Face names and stores them (see the module docstring)."""
    import mlx.core as mx

    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith(_OFFSET_NORMS):
            value = value - mx.array(1.0, dtype=value.dtype)
        if name.endswith("conv1d.weight"):
            value = value.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        out[name] = value
    for i in range(layers):
        p = f"language_model.model.layers.{i}.mlp."
        if p + "switch_mlp.gate_proj.weight" in out:
            gate, up = (
                out.pop(p + "switch_mlp.gate_proj.weight"),
                out.pop(p + "switch_mlp.up_proj.weight"),
            )
            out[p + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)  # [E, 2I, H]
            out[p + "experts.down_proj"] = out.pop(p + "switch_mlp.down_proj.weight")  # [E, H, I]
    renamed = {}
    for name, value in out.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        renamed[name.removeprefix("language_model.")] = value  # lm_head.weight
    mx.eval(renamed)
    return renamed
