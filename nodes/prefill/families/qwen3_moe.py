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
experts' tensors, or the stacked tensors' rows [lo, hi). Loads: the layer whole where it
fits; else attention as the dense family cuts it, the router, and the experts in the fewest
ranges that fit. Every expert streams (routing-aware loads are the streamer's next step).
MLX-quantized experts are dequantized one expert at a time, as they are used.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.prefill.blocks import LayerState
from tandem.nodes.prefill.dequant import aligned_front, dequantize
from tandem.nodes.prefill.families.base import Groups, Pass, Weights
from tandem.nodes.prefill.families.llama import (
    DenseFamily,
    _bounds,
    _fewest,
    _in_units,
    _layer_groups,
    attn_parts,
    dequantized,
    matrix_pieces,
    out_row_parts,
    row_unit,
)
from tandem.nodes.prefill.loads import ALIGN, Part, Piece, round_up, slot_size
from tandem.nodes.prefill.rope import rms_norm

MATRICES = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Routes:
    """Each token's experts and weights (one layer)."""

    experts: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k], the model dtype
    out: torch.Tensor  # [T, H] float32: the weighted experts' outputs so far


@dataclass
class MoeState(LayerState):
    routes: Routes | None = None


class Qwen3MoeFamily(DenseFamily):
    name = "qwen3_moe"
    State = MoeState

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        if not _sparse(index, layer):
            return super().whole_layer(index, layer)
        return attn_parts(index, layer, 1, with_o=True) + moe_parts(index, layer, 1)

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        if not _sparse(index, layer):
            return _layer_groups(index, layer, max_bytes, direct)
        whole = self.whole_layer(index, layer)
        if slot_size(whole, direct) <= max_bytes:
            return [whole]
        attn = _attention_loads(index, layer, max_bytes, direct)
        experts = index.spec.moe.num_experts  # type: ignore[union-attr]
        moe = _fewest(lambda g: moe_parts(index, layer, g), experts, max_bytes, direct)
        if attn is None or moe is None:
            return None
        return attn + [[p] for p in moe]

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        if part.op == "router":
            _route(p, part, weights, h, state)
            return False
        if part.op == "experts":
            _experts(p, part, weights, h, state)
            return False
        return super().compute(p, part, weights, h, state)


def _sparse(index: ModelIndex, layer: int) -> bool:
    moe = index.spec.moe
    return moe is not None and moe.sparse[layer]


def _stacked(index: ModelIndex, layer: int) -> bool:
    return "mlp.switch_mlp.gate_proj.weight" in index.layers[layer]


def moe_parts(index: ModelIndex, i: int, groups: int) -> list[Part]:
    """The router, then the experts in `groups` ranges."""
    moe = index.spec.moe
    assert moe is not None
    t = index.layers[i]
    norm = Piece("post_attention_layernorm.weight", t["post_attention_layernorm.weight"])
    router = Part(i, "router", 0, moe.num_experts, True, True,  # type: ignore[arg-type]
                  (norm, *matrix_pieces(index, i, "mlp.gate")))  # fmt: skip
    bounds = _bounds(moe.num_experts, groups)
    parts = [router]
    for g, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if _stacked(index, i):  # rows of the stacked [E, out, in] tensors: experts lo..hi
            modules = [f"mlp.switch_mlp.{m}" for m in MATRICES]
            pieces = [p for m in modules for p in matrix_pieces(index, i, m, rows=(lo, hi))]
        else:
            modules = [f"mlp.experts.{e}.{m}" for e in range(lo, hi) for m in MATRICES]
            pieces = [p for m in modules for p in matrix_pieces(index, i, m)]
        last = g == len(bounds) - 2
        parts.append(Part(i, "experts", lo, hi, g == 0, last, tuple(pieces)))  # type: ignore[arg-type]
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
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    state.routes = Routes(experts, weights, out)


def _experts(p: Pass, part: Part, w: Weights, h: torch.Tensor, state: LayerState) -> None:
    """Experts [lo, hi) on the tokens routed to them, grouped by expert: one SwiGLU each."""
    assert isinstance(state, MoeState) and state.routes is not None and state.x_norm is not None
    r, x = state.routes, state.x_norm
    tokens, slots = ((r.experts >= part.lo) & (r.experts < part.hi)).nonzero(as_tuple=True)
    local = r.experts[tokens, slots] - part.lo
    order = torch.argsort(local, stable=True)
    tokens, slots = tokens[order], slots[order]
    counts = torch.bincount(local, minlength=part.hi - part.lo).tolist()  # one read-back a part
    at = 0
    for j, n in enumerate(counts):
        if not n:
            continue
        rows = tokens[at : at + n]
        xe = x[rows]  # [n, H]
        act = F.silu(F.linear(xe, _matrix(p, w, part, j, "gate_proj")))  # [n, I]
        act.mul_(F.linear(xe, _matrix(p, w, part, j, "up_proj")))
        y = (
            F.linear(act, _matrix(p, w, part, j, "down_proj")).float()
            * r.weights[rows, slots[at : at + n]].float()[:, None]
        )
        r.out.index_add_(0, rows, y)
        at += n
    if part.last:
        h += r.out.to(h.dtype)
        state.routes, state.x_norm = None, None


def _matrix(p: Pass, w: Weights, part: Part, j: int, m: str) -> torch.Tensor:
    """Expert lo + j's `m` matrix (gate, up [I, H]; down [H, I]): a view into the slot, or
    dequantized into the scratch's front (the matrix before it is used already: the plan
    may size the scratch for one matrix)."""
    stacked = "mlp.switch_mlp.gate_proj.weight" in w
    module = f"mlp.switch_mlp.{m}" if stacked else f"mlp.experts.{part.lo + j}.{m}"
    pick = (lambda t: t[j]) if stacked else (lambda t: t)
    words = pick(w[f"{module}.weight"])
    quant = p.index.quant(part.layer, module)
    if quant is None:
        return words
    scales, biases = pick(w[f"{module}.scales"]), pick(w[f"{module}.biases"])
    rows, cols = scales.shape[0], scales.shape[1] * quant.group_size
    nbytes = rows * cols * torch.finfo(p.dtype).bits // 8
    dest = aligned_front(p.scratch, nbytes)
    into = dest[:nbytes].view(p.dtype).view(rows, cols)
    return dequantize(words, scales, biases, quant, p.dtype, into, dest[round_up(nbytes, ALIGN) :])
