"""`tandem make-model --arch glm4_moe`: GLM-4.x MoE's config and weights.

The weights are made by mlx-lm's own model class (`mlx_lm.models.glm4_moe`), randomly
initialised from `seed`, with every RMSNorm weight redrawn as 1 + 0.1·N(0, 1) and the router's
weight as N(0, 1/hidden) (mlx-lm initialises it to zeros: every score would be one half), its
correction bias as 0.1·N(0, 1), kept float32 as the checkpoints and mlx-lm keep it
(`router_bias` B > 0 adds B to experts 0..top_k-1's: every token then chooses them, so a short
prompt chooses few). q/k/v have biases (`attention_bias`, as GLM-4.5's). Two expert layouts of
the same numbers:

- "stacked": as mlx-lm saves it, `mlp.switch_mlp.{gate,up,down}_proj.weight` [E, out, in];
- "per-expert": as Hugging Face ships GLM-4.5, `mlp.experts.E.{gate,up,down}_proj.weight`, with
  its multi-token-prediction layer `model.layers.{layers}.*` (`num_nextn_predict_layers`: 1),
  which mlx-lm's `sanitize` drops.

mlx is imported inside functions only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tandem.nodes.model.factory_keys import DecoderArgs, decoder_keys

if TYPE_CHECKING:
    import mlx.core as mx

ARCH = "glm4_moe"
_LAYOUTS = ("stacked", "per-expert")
# the multi-token-prediction layer's own tensors, beside a decoder layer's (GLM-4.5's names)
_MTP_NORMS = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")


class Glm4Args(DecoderArgs, Protocol):
    """The fields of `factory.MakeModelArgs` read here."""

    dtype: str
    seed: int
    shards: int
    rope_theta: float | None
    rope_scaling: str
    tie_embeddings: bool
    experts: int
    top_k: int
    moe_intermediate: int
    norm_topk_prob: bool
    expert_layout: str
    router_bias: float
    first_dense: int
    n_group: int
    topk_group: int
    shared_experts: int
    routed_scaling: float
    partial_rotary: float
    qk_norm: bool


def glm4_config(a: Glm4Args, head_dim: int, eos: int, bos: int) -> dict[str, Any]:
    """config.json as GLM-4.5's checkpoints write it (every key mlx-lm's ModelArgs needs)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": ARCH,
        **decoder_keys(a, head_dim),
        "moe_intermediate_size": a.moe_intermediate,
        "n_routed_experts": a.experts,
        "n_shared_experts": a.shared_experts,
        "num_experts_per_tok": a.top_k,
        "routed_scaling_factor": a.routed_scaling,
        "n_group": a.n_group,
        "topk_group": a.topk_group,
        "norm_topk_prob": a.norm_topk_prob,
        "first_k_dense_replace": a.first_dense,
        "partial_rotary_factor": a.partial_rotary,
        "use_qk_norm": a.qk_norm,
        "attention_bias": True,
        "rope_theta": a.rope_theta or 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": a.dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "num_nextn_predict_layers": 1 if a.expert_layout == "per-expert" else 0,
    }


def glm4_problem(a: Glm4Args, head_dim: int) -> str | None:
    """Why no GLM-4.x MoE model can be made from these arguments, or None."""
    if a.expert_layout not in _LAYOUTS or a.rope_scaling != "none" or a.tie_embeddings:
        return "glm4_moe takes --expert-layout stacked or per-expert, no --rope-scaling, no ties"
    if a.shards != 1:
        return "glm4_moe is written as one safetensors file (--shards 1)"
    if a.experts < 1 or a.shared_experts < 0 or not 1 <= a.top_k <= a.experts:
        return "glm4_moe needs --experts, --shared-experts >= 0, --top-k in 1..experts"
    if a.experts % a.n_group or (a.n_group > 1 and a.experts // a.n_group < 2):
        return "--experts must come in whole --n-group groups of at least two"
    if not 1 <= a.topk_group <= a.n_group or not 0 <= a.first_dense <= a.layers:
        return "--topk-group in 1..n-group, --first-dense in 0..layers"
    if a.top_k > a.topk_group * a.experts // a.n_group:
        return "--top-k must fit in --topk-group groups' experts"
    rotary = int(head_dim * a.partial_rotary)
    if rotary < 2 or rotary % 2 or a.partial_rotary > 1:
        return f"--partial-rotary must turn an even number of head_dim {head_dim}'s dims"
    return None


def write_glm4(out: Path, a: Glm4Args, head_dim: int, eos: int, bos: int) -> None:
    """`config.json` and `model.safetensors` in `a.expert_layout` (the tokenizer is written)."""
    import mlx.core as mx

    config = glm4_config(a, head_dim, eos, bos)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = _mlx_weights(a, config)
    meta = {"format": "mlx"}
    if a.expert_layout == "per-expert":
        weights, meta = _hf_layout(weights, a), {"format": "pt"}
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=meta)


def _mlx_weights(a: Glm4Args, config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-lm's randomly initialised model's parameters (mlx names), the norms and the router
    redrawn, cast to `a.dtype` but the correction bias (mlx-lm's cast_predicate)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import glm4_moe

    mx.random.seed(a.seed)
    model = glm4_moe.Model(glm4_moe.ModelArgs.from_dict(config))
    dtype = getattr(mx, a.dtype)
    boost = mx.array([a.router_bias] * a.top_k + [0.0] * (a.experts - a.top_k))
    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * mx.random.normal(value.shape)
        elif name.endswith("mlp.gate.weight"):
            value = mx.random.normal(value.shape) * a.hidden**-0.5
        elif name.endswith("e_score_correction_bias"):
            weights[name] = 0.1 * mx.random.normal(value.shape) + boost  # float32
            continue
        weights[name] = value.astype(dtype)
    mx.eval(weights)
    return weights


def _hf_layout(weights: dict[str, mx.array], a: Glm4Args) -> dict[str, mx.array]:
    """The same weights as Hugging Face names them (experts one by one), with a
    multi-token-prediction layer after the last (the last layer's tensors again, and its
    own norms and projection)."""
    import mlx.core as mx

    out = dict(weights)
    for i in range(a.layers):
        p = f"model.layers.{i}.mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = out.pop(p + f"switch_mlp.{proj}.weight", None)
            for e in range(0 if stacked is None else stacked.shape[0]):
                out[p + f"experts.{e}.{proj}.weight"] = stacked[e]
    last, mtp = f"model.layers.{a.layers - 1}.", f"model.layers.{a.layers}."
    for name in [n for n in out if n.startswith(last)]:
        out[mtp + name.removeprefix(last)] = out[name]
    for name in _MTP_NORMS:
        out[mtp + name] = mx.ones((a.hidden,), dtype=getattr(mx, a.dtype))
    out[mtp + "eh_proj.weight"] = mx.zeros((a.hidden, 2 * a.hidden), dtype=getattr(mx, a.dtype))
    mx.eval(out)
    return out
