"""`tandem make-model --arch qwen3_moe`: a mixture of experts' weights and config keys.

A layer routes (its MLP is `num_experts` SwiGLU experts behind a linear router, `mlp.gate`
[E, H]) by mlx-lm's rule: unless listed in `mlp_only_layers`, where (i + 1) is a multiple of
`decoder_sparse_step`; the other layers hold a dense MLP of width `intermediate`.

Experts are written in one of two layouts, the same numbers in both (they are drawn stacked):
- "stacked" (mlx-community): `mlp.switch_mlp.{gate,up,down}_proj.weight` [E, out, in];
- "per-expert" (Hugging Face): `mlp.experts.{e}.{gate,up,down}_proj.weight` [out, in], which
  mlx-lm's `sanitize` stacks when it loads.

The router bias (`router_bias` B > 0) makes a short prompt use few experts: every token's
embedding gets a shared direction u (unit vector times sqrt(hidden), as large as a token's own
part), and the router rows of experts 0..top_k-1 get B·u/|u| added. Since the residual stream
keeps u, those experts' router logits rise by about B·sqrt(hidden/2) for every token in every
layer; B = 1 sends nearly every token to them, smaller B lets more tokens stray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
from tandem.nodes.model.index import PROJECTIONS, ExpertLayout

EXPERT_LAYOUTS: tuple[ExpertLayout, ...] = ("stacked", "per-expert")  # "fused": Qwen3.5's only
Mat = Callable[..., np.ndarray]  # mat(rows, cols, scale=1.0) -> [rows, cols] float32


class MoeArgs(Protocol):
    """The fields of `factory.MakeModelArgs` read here."""

    arch: str
    layers: int
    hidden: int
    seed: int
    rope_scaling: str
    experts: int
    top_k: int
    moe_intermediate: int
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    norm_topk_prob: bool
    expert_layout: ExpertLayout
    router_bias: float


def sparse_layers(a: MoeArgs) -> tuple[bool, ...]:
    """Per layer: whether its MLP is the experts (mlx-lm's rule, as `MoeSpec.sparse`); all
    False for the dense archs."""
    step, only = a.decoder_sparse_step, a.mlp_only_layers
    return tuple(
        a.arch == "qwen3_moe" and i not in only and a.experts > 0 and (i + 1) % step == 0
        for i in range(a.layers)
    )


def shared_direction(a: MoeArgs) -> np.ndarray | None:
    """[hidden] float32: the router bias's direction u, |u| = sqrt(hidden), or None without
    a bias (its own generator, so the other weights are the same with and without it)."""
    if a.arch != "qwen3_moe" or not a.router_bias:
        return None
    rng = np.random.default_rng([a.seed, 36])
    u = rng.standard_normal(a.hidden, dtype=np.float32)
    return u * np.float32(a.hidden**0.5 / np.linalg.norm(u))


def expert_weights(
    mat: Mat, prefix: str, a: MoeArgs, u: np.ndarray | None
) -> Iterator[tuple[str, np.ndarray]]:
    """One routed layer's MLP tensors: the router, then each projection in the layout.
    `mat` draws from the model's generator, so the draws are the same in either layout."""
    hidden, experts, inter = a.hidden, a.experts, a.moe_intermediate
    gate = mat(experts, hidden)  # [E, H]
    if u is not None:
        gate[: a.top_k] += np.float32(a.router_bias) * u / np.float32(np.linalg.norm(u))
    yield prefix + "mlp.gate.weight", gate
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    for proj in PROJECTIONS:
        rows, cols = shapes[proj]
        stacked = np.stack([mat(rows, cols) for _ in range(experts)])  # [E, out, in]
        if a.expert_layout == "stacked":
            yield f"{prefix}mlp.switch_mlp.{proj}.weight", stacked
        else:
            for e in range(experts):
                yield f"{prefix}mlp.experts.{e}.{proj}.weight", stacked[e]


def moe_config(a: MoeArgs) -> dict[str, object]:
    """Qwen3-MoE's config keys (mlx-lm's `ModelArgs` needs every one but the aux-loss ones);
    none for the dense archs."""
    if a.arch != "qwen3_moe":
        return {}
    return {
        "num_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "moe_intermediate_size": a.moe_intermediate,
        "decoder_sparse_step": a.decoder_sparse_step,
        "mlp_only_layers": sorted(a.mlp_only_layers),
        "norm_topk_prob": a.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a.layers,
    }


def moe_problem(a: MoeArgs) -> str | None:
    """Why no qwen3_moe model can be made from these arguments, or None."""
    if a.arch != "qwen3_moe":
        return None
    if a.experts < 1 or not 1 <= a.top_k <= a.experts:
        return "--experts must be positive and 1 <= --top-k <= --experts"
    if a.moe_intermediate < 1 or a.decoder_sparse_step < 1:
        return "--moe-intermediate and --decoder-sparse-step must be positive"
    if any(not 0 <= i < a.layers for i in a.mlp_only_layers):
        return f"--mlp-only-layers must name layers 0..{a.layers - 1}"
    if a.expert_layout not in EXPERT_LAYOUTS:
        return f"--expert-layout must be one of {EXPERT_LAYOUTS}"
    if a.rope_scaling != "none":  # mlx-lm's qwen3_moe ignores rope_scaling; transformers would not
        return "qwen3_moe takes no --rope-scaling (mlx-lm's qwen3_moe ignores it)"
    return None
