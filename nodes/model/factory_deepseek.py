"""`tandem make-model --arch deepseek_v3`: DeepSeek V3's config and weights (Kimi K2 is the
same architecture).

The weights are made by mlx-lm's own model class (`mlx_lm.models.deepseek_v3`), randomly
initialised from `seed`, the RMSNorm weights redrawn as 1 + 0.1·N(0, 1), the router (zeros in
mlx-lm) as N(0, 1/H) and its correction bias as 0.1·N(0, 1), kept float32 (`router_bias` B > 0
adds B to experts 0..top_k-1's, so a short prompt chooses few). `first_dense` = `layers`
makes every layer's MLP dense. Two layouts:

- "mlx": as mlx-lm saves it: the latent's up-projection split per head into `embed_q`
  [heads, kv_lora, nope] and `unembed_out` [heads, v, kv_lora]; experts stacked
  (`mlp.switch_mlp.*`);
- "hf": as DeepSeek ships it: `kv_b_proj` [heads · (nope + v), kv_lora] (each head's nope
  rows, then its v rows), experts one by one (`mlp.experts.E.*`).

mlx is imported inside functions only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tandem.nodes.model.factory_keys import DecoderArgs, decoder_keys

if TYPE_CHECKING:
    import mlx.core as mx

ARCH = "deepseek_v3"


class DeepseekArgs(DecoderArgs, Protocol):
    """The fields of `factory.MakeModelArgs` read here."""

    dtype: str
    seed: int
    rope_theta: float | None
    rope_scaling: str
    experts: int
    top_k: int
    moe_intermediate: int
    norm_topk_prob: bool
    router_bias: float
    layout: str
    first_dense: int
    n_group: int
    topk_group: int
    shared_experts: int
    routed_scaling: float
    kv_lora_rank: int
    q_lora_rank: int
    rope_head_dim: int
    nope_head_dim: int
    v_head_dim: int


def deepseek_config(a: DeepseekArgs, eos: int, bos: int) -> dict[str, Any]:
    """config.json as DeepSeek's checkpoints write it (every key mlx-lm's ModelArgs reads)."""
    keys = decoder_keys(a, a.nope_head_dim + a.rope_head_dim)
    del keys["head_dim"]  # DeepSeek's configs have none: q and k are nope + rope wide
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": ARCH,
        **keys,
        "num_key_value_heads": a.heads,
        "moe_intermediate_size": a.moe_intermediate,
        "n_routed_experts": a.experts,
        "n_shared_experts": a.shared_experts,
        "num_experts_per_tok": a.top_k,
        "routed_scaling_factor": a.routed_scaling,
        "n_group": a.n_group,
        "topk_group": a.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": a.norm_topk_prob,
        "first_k_dense_replace": a.first_dense,
        "moe_layer_freq": 1,
        "kv_lora_rank": a.kv_lora_rank,
        "q_lora_rank": a.q_lora_rank or None,
        "qk_rope_head_dim": a.rope_head_dim,
        "qk_nope_head_dim": a.nope_head_dim,
        "v_head_dim": a.v_head_dim,
        "rope_theta": a.rope_theta or 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": a.dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "num_nextn_predict_layers": 0,
    }
    if a.rope_scaling == "yarn":  # DeepSeek V3's own (its context: 4096 × 40)
        config["rope_scaling"] = {
            "type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
        }  # fmt: skip
    return config


def deepseek_problem(a: DeepseekArgs) -> str | None:
    """Why no DeepSeek V3 model can be made from these arguments, or None."""
    if a.layout not in ("mlx", "hf") or a.rope_scaling not in ("none", "yarn"):
        return "deepseek_v3 takes --layout mlx or hf, --rope-scaling none or yarn"
    if min(a.kv_lora_rank, a.rope_head_dim, a.nope_head_dim, a.v_head_dim) < 1 or (
        a.rope_head_dim % 2 or a.q_lora_rank < 0
    ):
        return "deepseek_v3 needs positive latent and head widths, an even --rope-head-dim"
    if a.experts < 1 or a.shared_experts < 1 or not 1 <= a.top_k <= a.experts:
        return "deepseek_v3 needs --experts and --shared-experts (--first-dense: dense layers)"
    if a.experts % a.n_group:
        return "--experts must come in whole --n-group groups"
    if not 1 <= a.topk_group <= a.n_group or not 0 <= a.first_dense <= a.layers:
        return "--topk-group in 1..n-group, --first-dense in 0..layers"
    return None


def write(out: Path, a: DeepseekArgs, head_dim: int, eos: int, bos: int) -> None:
    """`config.json` and `model.safetensors` in `a.layout` (the tokenizer is written already)."""
    import mlx.core as mx

    config = deepseek_config(a, eos, bos)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = _mlx_weights(a, config)
    meta = {"format": "mlx"}
    if a.layout == "hf":
        weights, meta = _hf_layout(weights, a), {"format": "pt"}
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=meta)


def _mlx_weights(a: DeepseekArgs, config: dict[str, Any]) -> dict[str, mx.array]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v3

    mx.random.seed(a.seed)
    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(config))
    dtype = getattr(mx, a.dtype)
    boost = mx.array([a.router_bias] * a.top_k + [0.0] * (a.experts - a.top_k))
    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("norm.weight", "layernorm.weight")):
            value = 1.0 + 0.1 * mx.random.normal(value.shape)
        elif name.endswith("mlp.gate.weight"):  # mlx-lm starts the router at zeros
            value = mx.random.normal(value.shape) * a.hidden**-0.5
        elif name.endswith("e_score_correction_bias"):  # float32, as mlx-lm keeps it
            weights[name] = 0.1 * mx.random.normal(value.shape) + boost
            continue
        weights[name] = value.astype(dtype)
    mx.eval(weights)
    return weights


def _hf_layout(weights: dict[str, mx.array], a: DeepseekArgs) -> dict[str, mx.array]:
    """The same weights as DeepSeek names and stores them (see the module docstring)."""
    import mlx.core as mx

    out = dict(weights)
    for i in range(a.layers):
        p = f"model.layers.{i}."
        wk = out.pop(p + "self_attn.embed_q.weight")  # [heads, kv_lora, nope]
        wv = out.pop(p + "self_attn.unembed_out.weight")  # [heads, v, kv_lora]
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)  # [heads, nope + v, kv_lora]
        out[p + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = out.pop(p + f"mlp.switch_mlp.{proj}.weight", None)
            for e in range(0 if stacked is None else stacked.shape[0]):
                out[p + f"mlp.experts.{e}.{proj}.weight"] = stacked[e]
    mx.eval(out)
    return out
