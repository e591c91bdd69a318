"""The DeepSeek-V3 lineage's mixture of experts (`topk_method: noaux_tc`; GLM-4.x MoE, DeepSeek
V3, Kimi K2): its config keys, read as mlx-lm's `glm4_moe.py` and `deepseek_v3.py` read them,
and the tensors a layer's MLP holds.

- Layers 0..`first_k_dense_replace`-1 keep a dense SwiGLU MLP (`intermediate_size`); the others
  route (DeepSeek V3: also only where `layer_idx % moe_layer_freq == 0`).
- The router `mlp.gate` holds a bare weight [E, H] (mlx-lm's `MoEGate`: no Linear, so never
  quantized) and `e_score_correction_bias` [E], which checkpoints store, and mlx-lm keeps, in
  float32 (its `cast_predicate`). Scores are sigmoid(x · Wᵀ) in float32; the bias is added for
  the choice only (in the best `topk_group` of `n_group` groups where n_group > 1); the chosen
  experts' unbiased scores, renormalised where `norm_topk_prob` (and top-k > 1), times
  `routed_scaling_factor`, weight their outputs.
- Every routed layer adds `n_shared_experts` × `moe_intermediate_size` of shared experts
  (`mlp.shared_experts.*`, a SwiGLU MLP without a gate) on every token.
- mlx-lm runs sigmoid scoring and `noaux_tc` whatever the config says (it asserts the method
  only): a config naming another method or scoring function is refused by name.
- The checkpoints hold multi-token-prediction layers past `num_hidden_layers`, which mlx-lm's
  `sanitize` drops (`MTP_FAMILIES`: the index skips them too).

A leaf module but for `MoeSpec`, imported where it is built: `spec.py` imports this module's
callers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.nodes.model.errors import ModelError

if TYPE_CHECKING:
    from tandem.nodes.model.spec import ModelSpec, MoeSpec

MTP_FAMILIES = ("glm4_moe", "deepseek_v3")  # layers past num_hidden_layers: skipped, not refused
CORRECTION_BIAS = "mlp.gate.e_score_correction_bias"  # [E] float32 in a model of any dtype
ROUTER_FLOAT = ("mlp.gate.weight", CORRECTION_BIAS)  # never quantized (no Linear in mlx-lm)
SHARED = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
          "mlp.shared_experts.down_proj")  # fmt: skip
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def read_noaux_moe(config: dict[str, Any], layers: int, where: Path, layer_freq: bool) -> MoeSpec:
    """The routed layers and their router, from a config's keys (`layer_freq`: routed layers
    also need `layer_idx % moe_layer_freq == 0`, DeepSeek V3's rule)."""
    from tandem.nodes.model.spec import MoeSpec  # spec.py imports this module's callers

    method = config.get("topk_method") or "noaux_tc"
    scoring = config.get("scoring_func") or "sigmoid"
    if method != "noaux_tc" or scoring != "sigmoid":
        raise ModelError(
            f"{where}: topk_method {method!r}, scoring_func {scoring!r}: mlx-lm routes by "
            "noaux_tc with sigmoid scores only"
        )
    try:
        experts = int(config["n_routed_experts"])
        top_k = int(config["num_experts_per_tok"])
        width = int(config["moe_intermediate_size"])
        first_dense = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1) if layer_freq else 1
        shared = config.get("n_shared_experts")  # None: no shared experts (mlx-lm's rule)
        groups = int(config.get("n_group") or 1)
        topk_groups = int(config.get("topk_group") or 1)
        scaling = float(config.get("routed_scaling_factor") or 1.0)
        norm = bool(config.get("norm_topk_prob", True))
    except KeyError as e:
        raise ModelError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: malformed value ({e})") from None
    if experts < 1 or not 1 <= top_k <= experts or width < 1 or freq < 1:
        raise ModelError(
            f"{where}: top-{top_k} of {experts} experts {width} wide, moe_layer_freq {freq}"
        )
    if groups < 1 or experts % groups or not 1 <= topk_groups <= groups:
        raise ModelError(
            f"{where}: {experts} experts in n_group {groups}, topk_group {topk_groups}"
        )
    if groups > 1 and (experts // groups < 2 or top_k > topk_groups * experts // groups):
        # mlx-lm scores a group by its best two; a choice beyond the kept groups takes zeros
        raise ModelError(
            f"{where}: n_group {groups} of {experts} experts, top-{top_k} within "
            f"topk_group {topk_groups}: each group needs two experts and the kept groups k"
        )
    sparse = tuple(i >= first_dense and i % freq == 0 for i in range(layers))
    return MoeSpec(
        experts, top_k, width, norm, sparse,
        shared_intermediate_size=width * int(shared or 0), scoring="sigmoid", groups=groups,
        topk_groups=topk_groups, routed_scaling=scaling,
    )  # fmt: skip


def noaux(spec: ModelSpec) -> bool:
    """Whether `spec`'s experts are the DeepSeek-V3 lineage's (this module's)."""
    return spec.moe is not None and spec.moe.scoring == "sigmoid"


def noaux_mlp_shapes(spec: ModelSpec, layer: int, layout: str) -> dict[str, tuple[int, ...]]:
    """The MLP tensors of decoder layer `layer` (logical float shapes): a dense SwiGLU, or the
    router [E, H] with its correction bias [E], the shared experts and the routed experts
    (`layout` "stacked": mlx-lm's `mlp.switch_mlp.*` [E, out, in]; "per-expert": Hugging
    Face's `mlp.experts.E.*` [out, in] each)."""
    moe, h = spec.moe, spec.hidden_size
    assert moe is not None
    if not moe.sparse[layer]:
        return _swiglu("mlp", h, spec.intermediate_size)
    n, inter = moe.num_experts, moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (n, h), CORRECTION_BIAS: (n,)}
    if moe.shared_intermediate_size:
        shapes.update(_swiglu("mlp.shared_experts", h, moe.shared_intermediate_size))
    each = _swiglu("", h, inter)
    for proj in _PROJECTIONS:
        shape = each[f".{proj}.weight"]
        if layout == "stacked":
            shapes[f"mlp.switch_mlp.{proj}.weight"] = (n, *shape)
        else:
            shapes.update({f"mlp.experts.{e}.{proj}.weight": shape for e in range(n)})
    return shapes


def _swiglu(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }
