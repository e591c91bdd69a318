"""The DeepSeek-V3 lineage's MLP on the prefill (GLM-4.x MoE, DeepSeek V3), as mlx-lm's
`glm4_moe.py` and `deepseek_v3.py` compute it, beside whatever attention a family has.

A layer's MLP is dense (layers before `first_k_dense_replace`: the dense family's SwiGLU, cut as
it cuts it), or routed, in parts:
- "router": the post-attention norm, `mlp.gate` [E, H] and its correction bias [E] (float32):
  each token's experts and weights (`kernels/noaux_router.py`), kept in the layer's state as
  Qwen3-MoE's `Routes`, with a float32 sum;
- "shared": the shared experts, a SwiGLU without a gate, on every token, into that sum;
- "experts", one per routed expert (stacked `mlp.switch_mlp.*` or Hugging Face's one by one):
  the chosen ones of a load at once (`experts.compute_experts`), their outputs times the
  float32 weights summed in float32 (as mlx-lm sums them); the last adds the sum into h.
mlx-lm rounds the routed sum to the model dtype before it adds the shared experts' output;
here both meet in float32 first (one rounding fewer; the same in a float32 model).

Loads: a layer whole where it is resident. Streamed: a dense layer whole where it fits, else
its attention loads, then its MLP cut as the dense family cuts it; a routed layer's attention
loads, the router and the shared experts joining the last of them where they fit, then the
experts packed into loads of experts only, read once the router has chosen (`routing`).
The shared experts are one part, never cut: n_shared_experts is 1 in GLM-4.x, DeepSeek V3
and Kimi K2, so they are an expert's size, which a slot must hold anyway.

The seam for a family with its own attention (DeepSeek V3's latent attention): subclass
`NoauxMoeFamily` and override
- `attention_parts(index, layer)`: the attention uncut (`whole_layer` puts it first);
- `attention_loads(index, layer, max_bytes, direct)`: it in loads of at most `max_bytes` (the
  last one may take the router and the shared experts beside it), or None where none fits;
- `compute_attention(p, part, weights, h, state)`: one of its parts (ops "attn", "qkv", "o");
  True when what the layer hands over is final;
and, where its cache holds other than K/V per KV head, `begin`, `new_state` and `handover`.
The MLP's parts, loads and compute, `routing` and `compute_experts` are this module's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.noaux_moe_config import CORRECTION_BIAS, SHARED
from tandem.nodes.prefill.families.base import Groups, Pass, Weights
from tandem.nodes.prefill.families.llama import (
    DenseFamily,
    attn_parts,
    dequantized,
    matrix_pieces,
    shard_attention,
    shard_mlp,
    shard_unit,
)
from tandem.nodes.prefill.families.llama import mlp_parts as dense_mlp_parts
from tandem.nodes.prefill.families.qwen3_5 import _dense_loads, _experts_apart
from tandem.nodes.prefill.families.qwen3_moe import (
    MoeState,
    Qwen3MoeFamily,
    _attention_loads,
    make_routes,
    moe_parts,
)
from tandem.nodes.prefill.kernels.blocks import LayerState
from tandem.nodes.prefill.kernels.noaux_router import noaux_select
from tandem.nodes.prefill.kernels.rope import rms_norm
from tandem.nodes.prefill.planning.loads import Part, Piece, pack, slot_size
from tandem.nodes.prefill.ranks.shard import Shard, last_of

ATTENTION_OPS = frozenset({"attn", "qkv", "o"})


class NoauxMoeFamily(DenseFamily):
    """The dense family's attention with the lineage's MLP; a family with other attention
    overrides the `attention_*` methods (the module docstring's seam)."""

    name = "noaux_moe"
    State = MoeState

    def attention_parts(self, index: ModelIndex, layer: int) -> list[Part]:
        """The layer's attention uncut: the dense family's, o_proj included."""
        return attn_parts(index, layer, 1, with_o=True)

    def attention_loads(
        self, index: ModelIndex, layer: int, max_bytes: int, direct: bool
    ) -> Groups:
        """The attention in loads that fit: whole, else the dense family's KV-head groups and
        o_proj rows."""
        return _attention_loads(index, layer, max_bytes, direct)

    def shard_attention(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        """A rank's share of the attention uncut: the dense family's heads."""
        return [shard_attention(index, layer, shard)]

    def shard_layer(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        """The rank's attention; its rows of a dense MLP, or the router (on every rank), its
        rows of the shared experts and its block of the routed ones."""
        attn = self.shard_attention(index, layer, shard)
        if not _sparse(index, layer):
            return [*attn, shard_mlp(index, layer, shard)]
        router, *rest = mlp_parts(index, layer)
        moe = index.spec.moe
        assert moe is not None
        lo, hi = shard.range(moe.num_experts, what="experts")
        parts = [router, *(p for p in rest if p.op == "experts" and lo <= p.lo < hi)]
        if moe.shared_intermediate_size:
            unit = shard_unit(index, layer, SHARED[2])
            a, b = shard.range(moe.shared_intermediate_size, unit, "shared expert features")
            pieces = (*matrix_pieces(index, layer, SHARED[0], rows=(a, b)),
                      *matrix_pieces(index, layer, SHARED[1], rows=(a, b)),
                      *matrix_pieces(index, layer, SHARED[2], cols=(a, b)))  # fmt: skip
            parts.insert(1, Part(layer, "shared", a, b, True, True, pieces))
        return [*attn, *last_of(parts)]

    def compute_attention(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        """An attention part, as the dense family computes it."""
        return super().compute(p, part, weights, h, state)

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        return [*self.attention_parts(index, layer), *mlp_parts(index, layer)]

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        """A dense layer whole where it fits, else its attention loads then its MLP cut; a
        routed layer's attention loads, then its router, shared experts and experts (experts
        in loads of their own, read once routed)."""
        routed = _sparse(index, layer)
        if not routed:
            whole = self.whole_layer(index, layer)
            if slot_size(whole, direct) <= max_bytes:
                return [whole]
        attn = self.attention_loads(index, layer, max_bytes, direct)
        if attn is None:
            return None
        if not routed:
            mlp = _dense_loads(index, layer, max_bytes, direct)
            return None if mlp is None else [*attn, *mlp]
        rest = pack(mlp_parts(index, layer), max_bytes, direct, first=attn[-1],
                    joins=_experts_apart)  # fmt: skip
        return None if rest is None else [*attn[:-1], *rest]

    routing = Qwen3MoeFamily.routing  # the experts the router chose, as Qwen3-MoE's
    compute_experts = Qwen3MoeFamily.compute_experts  # a load of experts at once

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        if part.op in ATTENTION_OPS:
            return self.compute_attention(p, part, weights, h, state)
        if part.op == "router":
            route(p, part, weights, h, state)
        elif part.op == "shared":
            shared_experts(p, dequantized(p, part, weights), state)
        else:  # a dense layer's MLP ("mlp", "gate_up", "down")
            return super().compute(p, part, weights, h, state)
        return False


def _sparse(index: ModelIndex, layer: int) -> bool:
    moe = index.spec.moe
    return moe is not None and moe.sparse[layer]


def mlp_parts(index: ModelIndex, i: int) -> list[Part]:
    """Layer i's MLP uncut: the dense one, or the router (with its correction bias), the
    shared experts (where there are any) and one part per routed expert."""
    if not _sparse(index, i):
        return dense_mlp_parts(index, i, 1, with_down=True)
    moe, t = index.spec.moe, index.layers[i]
    assert moe is not None
    router, *experts = moe_parts(index, i)
    bias = Piece(CORRECTION_BIAS, t[CORRECTION_BIAS])
    router = dataclasses.replace(router, pieces=(*router.pieces, bias))
    if not moe.shared_intermediate_size:
        return [router, *experts]
    pieces = tuple(pc for m in SHARED for pc in matrix_pieces(index, i, m))
    shared = Part(i, "shared", 0, moe.shared_intermediate_size, True, True, pieces)
    return [router, shared, *experts]


def route(p: Pass, part: Part, w: Weights, h: torch.Tensor, state: LayerState) -> None:
    """The router: the post-attention norm, the logits x · Wᵀ [T, E] in the model dtype (as
    mlx-lm's `x @ weight.T`), each token's experts and float32 weights (`noaux_select`)."""
    moe = p.spec.moe
    assert moe is not None and isinstance(state, MoeState)
    x = rms_norm(h, w["post_attention_layernorm.weight"], p.spec.rms_norm_eps)  # [T, H]
    gate = dequantized(p, part, w)["mlp.gate.weight"]  # [E, H]
    experts, weights = noaux_select(F.linear(x, gate), w[CORRECTION_BIAS], moe)
    state.x_norm = x
    state.routes = make_routes(experts, weights, moe.num_experts, h)


def shared_experts(p: Pass, w: Mapping[str, torch.Tensor], state: LayerState) -> None:
    """The shared experts on every token (a SwiGLU, no gate), in token chunks, into the
    router's float32 sum (the experts' last part adds it into h)."""
    assert isinstance(state, MoeState) and state.routes is not None and state.x_norm is not None
    x, out = state.x_norm, state.routes.out
    gate, up, down = (f"{m}.weight" for m in SHARED)
    for c0 in range(0, x.shape[0], p.chunk):
        xc = x[c0 : c0 + p.chunk]  # [c, H]
        # each weight asked for right before its use: a quantized one may share its scratch
        act = F.silu(F.linear(xc, w[gate]))  # [c, I_shared]
        act.mul_(F.linear(xc, w[up]))
        out[c0 : c0 + p.chunk] += F.linear(act, w[down]).float()
