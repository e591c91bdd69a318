"""Qwen3-MoE: the dense family's attention (q/k norms), and on its sparse layers a mixture of
experts in place of the MLP (mlx-lm's `qwen3_moe.py`, `switch_layers.py`).

A sparse layer's MLP is two kinds of part:
- "router": the post-attention norm and `mlp.gate` (hidden → experts): softmax, the top-k
  experts of each token and their weights (renormalised where `norm_topk_prob`), kept in the
  layer's state with a float32 accumulator;
- "experts" over experts [lo, hi): each expert's SwiGLU on the tokens routed to it (one
  matmul per used expert), its output times the token's weight added into the accumulator;
  the last such part adds the accumulator into the residual.

Experts are stored one by one (Hugging Face: `mlp.experts.E.{gate,up,down}_proj`) or stacked
(mlx-community: `mlp.switch_mlp.{gate,up,down}_proj` [E, out, in]); a part's pieces are the
experts' tensors, or the stacked tensors' rows [lo, hi), one part per expert. Loads: the
layer whole where it is resident; streamed, its attention (as the dense family cuts it) with
the router, then its experts packed into loads, which the streamer reads once the router has
chosen, only the chosen experts' pieces of them (`routing`).
A load's experts compute at once (`experts.py`: a few dozen kernels, MLX-quantized ones
dequantized in one call per matrix). The resident
set holds whole layers, as for dense models (the planner's fixed choice, never LRU): a layer
kept resident needs no router wait at all, while a fixed set of "hot" experts would need a
router's counts from past prompts to choose, and would still leave every layer's routing wait.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.prefill.families.base import Groups, Pass, Weights
from tandem.nodes.prefill.families.llama import (
    DenseFamily,
    _fewest,
    _in_units,
    _layer_groups,
    attn_parts,
    dequantized,
    matrix_pieces,
    out_row_parts,
    row_unit,
    shard_attention,
)
from tandem.nodes.prefill.kernels.blocks import LayerState
from tandem.nodes.prefill.kernels.experts import compute_experts
from tandem.nodes.prefill.kernels.rope import rms_norm
from tandem.nodes.prefill.planning.loads import Part, Piece, pack, slot_size
from tandem.nodes.prefill.ranks.shard import Shard, last_of

MATRICES = ("gate_proj", "up_proj", "down_proj")
FUSED = ("gate_up_proj", "down_proj")  # Hugging Face's Qwen3.5-MoE experts


@dataclass
class Routes:
    """Each token's experts and weights (one layer), grouped by expert."""

    order: torch.Tensor  # [T·k] int64: the flat (token, slot) entries sorted by expert
    weights: torch.Tensor  # [T·k] each entry's weight: the model dtype (float32: noaux_tc)
    starts: list[int]  # per expert: where its entries begin in `order` (E + 1 values)
    k: int  # experts per token
    out: torch.Tensor  # [T, H] float32: the weighted experts' outputs so far

    @property
    def used(self) -> frozenset[int]:
        return frozenset(
            e for e in range(len(self.starts) - 1) if self.starts[e + 1] > self.starts[e]
        )


@dataclass
class MoeState(LayerState):
    routes: Routes | None = None


class Qwen3MoeFamily(DenseFamily):
    name = "qwen3_moe"
    State = MoeState

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        if not _sparse(index, layer):
            return super().whole_layer(index, layer)
        return attn_parts(index, layer, 1, with_o=True) + moe_parts(index, layer)

    def shard_layer(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        """The rank's attention; a sparse layer's router whole, then the rank's block of the
        experts (`shard_experts`)."""
        if not _sparse(index, layer):
            return super().shard_layer(index, layer, shard)
        return [shard_attention(index, layer, shard), *shard_experts(index, layer, shard)]

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        """A sparse layer streams as its attention (cut as the dense family cuts it) with the
        router in its last load, then its experts packed in order into loads that fit, so
        that they are read once the router has chosen (`routing`)."""
        if not _sparse(index, layer):
            return _layer_groups(index, layer, max_bytes, direct)
        attn = _attention_loads(index, layer, max_bytes, direct)
        router, *experts = moe_parts(index, layer)
        if attn is None or slot_size([router], direct) > max_bytes:
            return None
        if slot_size([*attn[-1], router], direct) <= max_bytes:
            attn[-1] = [*attn[-1], router]
        else:
            attn.append([router])
        loads = pack(experts, max_bytes, direct)  # None: one expert does not fit a slot
        return None if loads is None else attn + loads

    def compute_experts(
        self,
        p: Pass,
        parts: Sequence[Part],
        views: Mapping[str, torch.Tensor],
        h: torch.Tensor,
        state: LayerState,
    ) -> bool:
        """A load of experts, all of its chosen ones at once (`experts.py`)."""
        if not parts or any(part.op != "experts" for part in parts):
            return False
        compute_experts(p, parts, views, state, h)
        return True

    def routing(self, part: Part, state: LayerState) -> frozenset[int] | None:
        if part.op != "router":
            return None
        assert isinstance(state, MoeState) and state.routes is not None
        return state.routes.used

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        if part.op == "router":
            _route(p, part, weights, h, state)
            return False
        return super().compute(p, part, weights, h, state)


def shard_experts(index: ModelIndex, i: int, shard: Shard) -> list[Part]:
    """The router (every rank routes every token), then the rank's block of the experts, its
    last marked last (their sum is reduced over the ranks there)."""
    moe = index.spec.moe
    assert moe is not None
    lo, hi = shard.range(moe.num_experts, what="experts")
    router, *experts = moe_parts(index, i)
    return last_of([router, *(p for p in experts if lo <= p.lo < hi)])


def _sparse(index: ModelIndex, layer: int) -> bool:
    moe = index.spec.moe
    return moe is not None and moe.sparse[layer]


_MADE: dict[tuple[int, int], tuple[ModelIndex, list[Part]]] = {}  # (index, layer) → parts
_MADE_MOST = 4096


def moe_parts(index: ModelIndex, i: int) -> list[Part]:
    """The router, then one part per expert. Made once per layer of an index: a plan tries
    dozens of slot sizes, and the same parts (their pieces' sizes and spans cached) make a
    256-expert layer's packing several times cheaper than new ones each time."""
    made = _MADE.get((id(index), i))
    if made is not None and made[0] is index:
        return list(made[1])
    if len(_MADE) >= _MADE_MOST:
        _MADE.clear()
    parts = _moe_parts(index, i)
    _MADE[id(index), i] = (index, parts)
    return list(parts)


def _moe_parts(index: ModelIndex, i: int) -> list[Part]:
    moe = index.spec.moe
    assert moe is not None
    t = index.layers[i]
    norm = Piece("post_attention_layernorm.weight", t["post_attention_layernorm.weight"])
    router = Part(i, "router", 0, moe.num_experts, True, True,
                  (norm, *matrix_pieces(index, i, "mlp.gate")))  # fmt: skip
    parts, layout = [router], index.expert_layout(i)
    for lo in range(moe.num_experts):
        hi = lo + 1
        if layout == "stacked":  # rows of the stacked [E, out, in] tensors: experts lo..hi
            modules = [f"mlp.switch_mlp.{m}" for m in MATRICES]
            pieces = [p for m in modules for p in matrix_pieces(index, i, m, rows=(lo, hi))]
        elif layout == "fused":  # Qwen3.5's: gate_up [E, 2I, H], down [E, H, I], float
            pieces = [Piece(f"mlp.experts.{n}", t[f"mlp.experts.{n}"], rows=(lo, hi))
                      for n in FUSED]  # fmt: skip
        else:
            modules = [f"mlp.experts.{e}.{m}" for e in range(lo, hi) for m in MATRICES]
            pieces = [p for m in modules for p in matrix_pieces(index, i, m)]
        last = hi == moe.num_experts
        parts.append(Part(i, "experts", lo, hi, lo == 0, last, tuple(pieces)))
    return parts


def _attention_loads(index: ModelIndex, i: int, max_bytes: int, direct: bool) -> Groups:
    """Attention as the dense family cuts it: whole, else KV-head groups and o_proj rows."""
    whole = attn_parts(index, i, 1, with_o=True)
    if slot_size(whole, direct) <= max_bytes:
        return [whole]
    spec = index.spec
    heads = _fewest(lambda g: attn_parts(index, i, g, with_o=False), spec.num_kv_heads,
                    max_bytes, direct)  # fmt: skip
    rows = _in_units(
        lambda g, u: out_row_parts(index, i, "o", g, u), spec.hidden_size,
        row_unit(index, i, "self_attn.o_proj"), max_bytes, direct,
    )  # fmt: skip
    if heads is None or rows is None:
        return None
    return [[p] for p in heads + rows]


def _route(p: Pass, part: Part, w: Weights, h: torch.Tensor, state: LayerState) -> None:
    """The router: each token's top-k experts and their weights, as mlx-lm's block picks
    them (softmax in float32, back to the model dtype; renormalised where the config says)."""
    moe = p.spec.moe
    assert moe is not None and isinstance(state, MoeState)
    x = rms_norm(h, w["post_attention_layernorm.weight"], p.spec.rms_norm_eps)  # [T, H]
    gate = dequantized(p, part, w)["mlp.gate.weight"]  # [E, H]
    gates = torch.softmax(F.linear(x, gate).float(), dim=-1).to(h.dtype)
    weights, experts = torch.topk(gates, moe.experts_per_token, dim=-1)  # [T, k]
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    state.x_norm = x
    state.routes = make_routes(experts, weights, moe.num_experts, h)


def make_routes(
    experts: torch.Tensor, weights: torch.Tensor, num_experts: int, h: torch.Tensor
) -> Routes:
    """The routes of each token's `experts` [T, k] with their `weights` [T, k], and a zeroed
    float32 sum shaped as h [T, H]."""
    flat = experts.flatten()  # [T·k]
    # per expert, its entries: the one host read of the layer (CUDA's `bincount` reads the
    # indices' min and max back first: three round trips)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=h.device)
    counts = counts.index_add_(0, flat, torch.ones_like(flat)).tolist()
    starts = [0, *itertools.accumulate(counts)]
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    order = torch.argsort(flat, stable=True)
    return Routes(order, weights.flatten(), starts, experts.shape[-1], out)
