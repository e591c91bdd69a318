"""gpt-oss (`gpt_oss`): as mlx-lm's `gpt_oss.py` computes it.

- Attention: biases on q/k/v and o, a learned sink logit per query head in every softmax row
  (`kernels/sinks.py`), RoPE with YaRN scaling (q and k scaled by its mscale: folded into the
  pass's tables), "sliding" layers (a window of 128 in the released models) alternating with
  "full" ones. A sliding layer hands over all its new K/V, as Gemma 3's does: the prefix cache
  keeps them, only the window crosses the wire.
- Every layer's MLP is a mixture of experts: the router (`mlp.router`, with a bias) picks each
  token's top-k experts by logit, their weights the softmax of those k logits (in float32);
  the experts are SwiGLU-like with biases and a clamped gate (`kernels/experts_oai.py`).

Loads: a layer streams as Qwen3-MoE's do: its attention (whole, or cut by KV heads and o_proj
rows), with the router in its last load, then its experts packed into loads that the streamer
reads once the router has chosen, only the chosen experts' pieces of them. A part's pieces are
the stacked tensors' rows [e, e + 1): each projection's words (scales, biases) and its bias, in
mlx-lm's layout or OpenAI's fused MXFP4 one (`model/gpt_oss_tensors.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.spec import LayerKind
from tandem.nodes.prefill.families.base import Groups, Pass, Weights
from tandem.nodes.prefill.families.llama import (
    DenseFamily,
    attn_parts,
    dequantized,
    matrix_pieces,
    shard_attention,
)
from tandem.nodes.prefill.families.qwen3_moe import (
    MoeState,
    Qwen3MoeFamily,
    _attention_loads,
    make_routes,
)
from tandem.nodes.prefill.kernels.blocks import LayerState, attention_part
from tandem.nodes.prefill.kernels.experts_oai import compute_oai_experts
from tandem.nodes.prefill.kernels.rope import rms_norm, rope_mscale
from tandem.nodes.prefill.planning.loads import Part, Piece, pack, slot_size
from tandem.nodes.prefill.prefix_upload import KV, State
from tandem.nodes.prefill.ranks.shard import Shard, last_of

SINKS = "self_attn.sinks"
O_BIAS = "self_attn.o_proj.bias"


class GptOssFamily(DenseFamily):
    name = "gpt_oss"
    State = MoeState

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        return _with_attention_extras(index, attn_parts(index, layer, 1, with_o=True)) + (
            expert_parts(index, layer)
        )  # fmt: skip

    def shard_layer(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        """The rank's heads (every head's sinks; o_proj's bias, added once after the sum),
        the router, the rank's block of the experts."""
        attn = shard_attention(index, layer, shard)
        sinks = Piece(SINKS, index.layers[layer][SINKS])
        attn = dataclasses.replace(attn, pieces=(*attn.pieces, sinks))
        router, *experts = expert_parts(index, layer)
        moe = index.spec.moe
        assert moe is not None
        lo, hi = shard.range(moe.num_experts, what="experts")
        return [attn, *last_of([router, *(p for p in experts if lo <= p.lo < hi)])]

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        """The attention as the dense family cuts it (with the sinks and o's bias where they
        are used), the router in its last load, then the experts packed into loads."""
        attn = _attention_loads(index, layer, max_bytes, direct)
        if attn is None:
            return None
        attn = [_with_attention_extras(index, group) for group in attn]
        router, *experts = expert_parts(index, layer)
        if any(slot_size(g, direct) > max_bytes for g in attn) or (
            slot_size([router], direct) > max_bytes
        ):
            return None
        if slot_size([*attn[-1], router], direct) <= max_bytes:
            attn[-1] = [*attn[-1], router]
        else:
            attn.append([router])
        loads = pack(experts, max_bytes, direct)
        return None if loads is None else attn + loads

    def begin(self, p: Pass, h: torch.Tensor) -> Pass:
        """YaRN's mscale folded into the RoPE tables (mlx-lm scales q and k by it first)."""
        m = rope_mscale(p.spec)
        if m == 1.0:
            return p
        cos, sin = p.rope
        return dataclasses.replace(p, rope=(cos * m, sin * m))

    routing = Qwen3MoeFamily.routing  # the experts the router chose, as Qwen3-MoE's

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        if part.op == "router":
            _route(p, part, weights, h, state)
            return False
        if part.op == "experts":
            views = {f"experts:{part.lo}:{k}": v for k, v in weights.items()}
            compute_oai_experts(p, [part], views, state, h)
            return False
        if part.op in ("attn", "qkv"):
            attention_part(
                p.spec, h, state, dequantized(p, part, weights), part.lo, part.hi, part.first,
                p.start, p.rope, p.chunk, with_o=part.op == "attn",
                window=p.spec.layer_kinds[part.layer].window, reduce=p.reduce,
            )  # fmt: skip
            return part.last  # the layer's K/V are final
        super().compute(p, part, weights, h, state)  # o_proj's rows
        if part.op == "o":  # a cut o_proj: its rows' bias, after their products
            h[:, part.lo : part.hi] += weights[O_BIAS]
        return False

    def compute_experts(
        self,
        p: Pass,
        parts: Sequence[Part],
        views: Mapping[str, torch.Tensor],
        h: torch.Tensor,
        state: LayerState,
    ) -> bool:
        if not parts or any(part.op != "experts" for part in parts):
            return False
        compute_oai_experts(p, parts, views, state, h)
        return True

    def handover(self, p: Pass, kind: LayerKind, layer: int, state: LayerState) -> KV | State:
        """Every layer hands over its new K/V; a sliding one's window crosses the wire."""
        return state.k[:, :, p.start :], state.v[:, :, p.start :]


def _with_attention_extras(index: ModelIndex, parts: list[Part]) -> list[Part]:
    """Attention parts with the sinks (every head's, sliced by the part) where heads are
    attended, and o_proj's bias (its rows') where o_proj is."""
    t = index.layers[parts[0].layer]
    out = []
    for part in parts:
        pieces = list(part.pieces)
        if part.op in ("attn", "qkv"):
            pieces.append(Piece(SINKS, t[SINKS]))
        if part.op == "attn":
            pieces.append(Piece(O_BIAS, t[O_BIAS]))
        if part.op == "o":
            pieces.append(Piece(O_BIAS, t[O_BIAS], rows=(part.lo, part.hi)))
        out.append(dataclasses.replace(part, pieces=tuple(pieces)))
    return out


def expert_parts(index: ModelIndex, i: int) -> list[Part]:
    """The router (the post-attention norm, `mlp.router` and its bias), then one part per
    expert: its rows of each projection's stacked tensors and bias."""
    moe = index.spec.moe
    assert moe is not None
    t = index.layers[i]
    router = Part(i, "router", 0, moe.num_experts, True, True, (
        Piece("post_attention_layernorm.weight", t["post_attention_layernorm.weight"]),
        *matrix_pieces(index, i, "mlp.router"),
        Piece("mlp.router.bias", t["mlp.router.bias"]),
    ))  # fmt: skip
    fused = index.expert_layout(i) == "fused"
    projections = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    parts = [router]
    for e in range(moe.num_experts):
        pieces = []
        for proj in projections:
            module = f"mlp.experts.{proj}"
            pieces += matrix_pieces(index, i, module, rows=(e, e + 1))
            pieces.append(Piece(f"{module}.bias", t[f"{module}.bias"], rows=(e, e + 1)))
        last = e == moe.num_experts - 1
        parts.append(Part(i, "experts", e, e + 1, e == 0, last, tuple(pieces)))
    return parts


def _route(p: Pass, part: Part, w: Weights, h: torch.Tensor, state: LayerState) -> None:
    """Each token's top-k experts by router logit, weighted by the softmax of those k logits
    (float32, back to the model dtype), as mlx-lm's `MLPBlock` picks them."""
    moe = p.spec.moe
    assert moe is not None and isinstance(state, MoeState)
    x = rms_norm(h, w["post_attention_layernorm.weight"], p.spec.rms_norm_eps)  # [T, H]
    router = dequantized(p, part, w)["mlp.router.weight"]  # [E, H]
    logits = F.linear(x, router, w["mlp.router.bias"])  # [T, E]
    top, experts = torch.topk(logits, moe.experts_per_token, dim=-1)  # [T, k]
    weights = torch.softmax(top.float(), dim=-1).to(h.dtype)
    state.x_norm = x
    state.routes = make_routes(experts, weights, moe.num_experts, h)
