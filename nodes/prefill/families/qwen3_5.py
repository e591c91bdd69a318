"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`): three Gated DeltaNet layers for every full-attention
one, as mlx-lm's `qwen3_5.py` computes them.

- A "linear" layer's mixer is `linear_mixer.py`'s (projections, a causal conv, the gated delta
  rule in its chunked form, a gated norm, out_proj); it hands over its state after the
  prompt: "conv" [1, K-1, conv_dim] in the model dtype and "recurrent" [1, Hv, Dv, Dk] in
  float32 (`Header.state`), from a prefix's state where a cached prefix came before.
- A "full" layer's attention has a gated output (q_proj holds, per head, the query then a
  gate: o_proj takes attention · sigmoid(gate)), q/k RMS norms, and RoPE on the first
  `partial_rotary_factor` of each head's dims only.
- The MLP is dense, or (`qwen3_5_moe`, every layer) a mixture of experts as Qwen3-MoE's
  (`qwen3_moe.py`: router, experts streamed once routed) plus a shared expert scaled by
  sigmoid(`shared_expert_gate` · x), which runs beside the router.
- A Hugging Face checkpoint stores the input, post-attention and q/k norms' weights less one
  (`ModelIndex.norm_offset`): they are read plus the offset, as mlx-lm's sanitize loads them.

Loads: a layer whole where it fits; else its mixer (never cut) in one load, then the dense
MLP as the dense family cuts it, or the router with the shared expert and the experts packed
into loads as Qwen3-MoE's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.qwen3_5_config import LinearSpec
from tandem.nodes.model.spec import LayerKind, ModelSpec
from tandem.nodes.prefill.families.base import Groups, Pass, PrefillFamily, Weights
from tandem.nodes.prefill.families.llama import (
    _in_units,
    _out_rows,
    dequantized,
    matrix_pieces,
    mlp_parts,
    out_row_parts,
    row_unit,
    shard_mlp,
    shard_unit,
)
from tandem.nodes.prefill.families.qwen3_moe import (
    MoeState,
    Qwen3MoeFamily,
    _route,
    moe_parts,
    shard_experts,
)
from tandem.nodes.prefill.kernels.blocks import LayerState, _attend, fused_attention, mlp_part
from tandem.nodes.prefill.kernels.linear_mixer import linear_mixer
from tandem.nodes.prefill.kernels.rope import apply_rope, inv_freq, rms_norm, rope_tables
from tandem.nodes.prefill.planning.loads import Part, Piece, pack, slot_size
from tandem.nodes.prefill.prefix_upload import KV, Prefix, State
from tandem.nodes.prefill.ranks.shard import Shard

OFFSET_NORMS = frozenset({"input_layernorm.weight", "post_attention_layernorm.weight",
                          "self_attn.q_norm.weight", "self_attn.k_norm.weight"})  # fmt: skip
LINEAR_MATRICES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LINEAR_FLOATS = ("conv1d.weight", "dt_bias", "A_log", "norm.weight")
SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
          "mlp.shared_expert.down_proj", "mlp.shared_expert_gate")  # fmt: skip


@dataclass
class Qwen35State(MoeState):
    conv: torch.Tensor | None = None  # a linear layer's [K-1, conv_dim], the model dtype
    recurrent: torch.Tensor | None = None  # [Hv, Dv, Dk] float32


class Qwen35Family(PrefillFamily):
    name = "qwen3_5"
    State = Qwen35State

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        return [mixer_part(index, layer), *_mlp(index, layer)]

    def shard_layer(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        """The rank's heads of the mixer (`shard_mixer`); its rows of a dense MLP, or the
        router, its rows of the shared expert and its block of the experts."""
        mixer = shard_mixer(index, layer, shard)
        if not _sparse(index, layer):
            return [mixer, shard_mlp(index, layer, shard)]
        router, *experts = shard_experts(index, layer, shard)
        moe = index.spec.moe
        assert moe is not None
        if not moe.shared_intermediate_size:
            return [mixer, router, *experts]
        unit = shard_unit(index, layer, SHARED[2])
        lo, hi = shard.range(moe.shared_intermediate_size, unit, "shared expert features")
        pieces = (
            *matrix_pieces(index, layer, SHARED[0], rows=(lo, hi)),
            *matrix_pieces(index, layer, SHARED[1], rows=(lo, hi)),
            *matrix_pieces(index, layer, SHARED[2], cols=(lo, hi)),
            *(pc for m in SHARED[3:] for pc in matrix_pieces(index, layer, m)),
        )
        return [mixer, router, Part(layer, "shared", lo, hi, True, True, pieces), *experts]

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        """A dense layer whole where it fits a slot, else its mixer, then its MLP cut as the
        dense family cuts it. A sparse layer always as its mixer (with the router and the
        shared expert where they fit beside it), then its experts apart, read once routed
        (issue 48: returned whole where it fit, every expert crossed the link each pass)."""
        sparse = _sparse(index, layer)
        whole = self.whole_layer(index, layer)
        if not sparse and slot_size(whole, direct) <= max_bytes:
            return [whole]
        mixer = mixer_part(index, layer)
        if slot_size([mixer], direct) > max_bytes:
            return None  # a mixer is never cut
        if not sparse:
            mlp = _dense_loads(index, layer, max_bytes, direct)
            return None if mlp is None else [[mixer], *mlp]
        # the router, the shared expert, the experts; experts share loads only with experts
        # (those are read once routed)
        return pack(_mlp(index, layer), max_bytes, direct, first=[mixer], joins=_experts_apart)

    def begin(self, p: Pass, h: torch.Tensor) -> Pass:
        """The full layers' RoPE tables: over the first int(head_dim · factor) dims only."""
        spec = p.spec
        rotary = dataclasses.replace(spec, head_dim=int(spec.head_dim * spec.partial_rotary_factor))
        tables = rope_tables(inv_freq(rotary), p.start, h.shape[0], h.device)
        return dataclasses.replace(p, ropes={"full": tables})

    routing = Qwen3MoeFamily.routing  # the experts the router chose, as Qwen3-MoE's
    compute_experts = Qwen3MoeFamily.compute_experts  # a load of experts at once

    def new_state(
        self, p: Pass, kind: LayerKind, layer: int, count: int, prefix: Prefix | None
    ) -> LayerState:
        if kind.kind != "linear":
            return super().new_state(p, kind, layer, count, prefix)
        lin, device = p.spec.linear, p.scratch.device
        assert lin is not None
        empty = torch.empty(0, device=device)
        if p.start and isinstance(prefix, dict):  # the state after the cached prefix
            conv = prefix["conv"][0].to(device, p.dtype, copy=True)
            recurrent = prefix["recurrent"][0].to(device, torch.float32, copy=True)
        else:
            conv = torch.zeros(lin.conv_kernel - 1, lin.conv_dim, dtype=p.dtype, device=device)
            shape = (lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)
            recurrent = torch.zeros(shape, dtype=torch.float32, device=device)
        if p.shard.world > 1:  # the rank's channels and heads
            channels, _, heads = linear_ranges(lin, p.shard)
            conv = torch.cat([conv[:, a:b] for a, b in channels], dim=1)
            recurrent = recurrent[heads[0] : heads[1]].clone()
        return Qwen35State(empty, empty, conv=conv, recurrent=recurrent)

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        assert isinstance(state, Qwen35State)
        if part.op == "down":
            _out_rows(p, part, weights, h, state)
            return False
        w = _Offset(dequantized(p, part, weights), p.index.norm_offset)
        spec = p.spec
        if part.op == "linear":
            x = rms_norm(h, w["input_layernorm.weight"], spec.rms_norm_eps)
            assert spec.linear is not None and state.conv is not None
            assert state.recurrent is not None
            lin = spec.linear
            if p.shard.world > 1:  # the rank's heads
                g = lin.num_v_heads // lin.num_k_heads
                lin = replace(lin, num_k_heads=(part.hi - part.lo) // g,
                              num_v_heads=part.hi - part.lo)  # fmt: skip
            out, state.conv, state.recurrent = linear_mixer(
                x, w, lin, spec.rms_norm_eps, state.conv, state.recurrent, p.chunk
            )
            h += out if p.reduce is None else p.reduce(out)
            return True  # the state is final
        if part.op == "attn":
            _gated_attention(p, h, state, w, part.lo, part.hi)
            return True  # the K/V are final
        if part.op == "router":
            _route(p, part, w, h, state)
        elif part.op == "shared":
            _shared(p, w, state)
        else:
            mlp_part(spec, h, state, w, part.first, p.chunk, part.lo, part.hi,
                     with_down=part.op == "mlp", reduce=p.reduce)  # fmt: skip
        return False

    def handover(self, p: Pass, kind: LayerKind, layer: int, state: LayerState) -> KV | State:
        if kind.kind != "linear":
            return super().handover(p, kind, layer, state)
        assert isinstance(state, Qwen35State)
        assert state.conv is not None and state.recurrent is not None
        conv, recurrent = state.conv, state.recurrent
        if p.shard.world > 1:  # the rank's share in place, zeros elsewhere (summed in rank 0)
            lin = p.spec.linear
            assert lin is not None
            channels, _, (a, b) = linear_ranges(lin, p.shard)
            conv = conv.new_zeros(lin.conv_kernel - 1, lin.conv_dim)
            at = 0
            for c0, c1 in channels:
                conv[:, c0:c1] = state.conv[:, at : at + c1 - c0]
                at += c1 - c0
            recurrent = recurrent.new_zeros(lin.num_v_heads, *recurrent.shape[1:])
            recurrent[a:b] = state.recurrent
        return {"conv": conv[None], "recurrent": recurrent[None]}


def _experts_apart(last: Part, part: Part) -> bool:
    """Whether `part` may join a load ending in `last`: an expert only another expert's."""
    return part.op != "experts" or last.op == "experts"


def _sparse(index: ModelIndex, layer: int) -> bool:
    moe = index.spec.moe
    return moe is not None and moe.sparse[layer]


def mixer_part(index: ModelIndex, i: int) -> Part:
    """A linear layer's "linear" part (its norm, projections, conv, decay and gated norm), or
    a full layer's whole gated attention ("attn")."""
    t = index.layers[i]
    pieces = [Piece("input_layernorm.weight", t["input_layernorm.weight"])]
    if index.spec.layer_kinds[i].kind == "linear":
        for m in LINEAR_MATRICES:
            pieces += matrix_pieces(index, i, f"linear_attn.{m}")
        pieces += [Piece(f"linear_attn.{n}", t[f"linear_attn.{n}"]) for n in LINEAR_FLOATS]
        assert index.spec.linear is not None
        return Part(i, "linear", 0, index.spec.linear.num_v_heads, True, True, tuple(pieces))
    for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
        pieces += matrix_pieces(index, i, f"self_attn.{m}")
    pieces += [Piece(n, t[n]) for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight")]
    return Part(i, "attn", 0, index.spec.num_kv_heads, True, True, tuple(pieces))


def shard_mixer(index: ModelIndex, i: int, shard: Shard) -> Part:
    """Rank `shard`'s mixer: a full layer's KV heads (q/gate, k, v rows; o_proj's columns);
    a linear layer's key heads with their value heads: q, k and v's rows of in_proj_qkv and
    the conv (three ranges: `module`, `module@k`, `module@v`), z/b/a rows, the decays'
    entries, out_proj's columns. Its lo/hi: KV heads, or value heads."""
    spec, t = index.spec, index.layers[i]
    norm = Piece("input_layernorm.weight", t["input_layernorm.weight"])
    if spec.layer_kinds[i].kind != "linear":
        lo, hi = shard.range(spec.num_kv_heads, what="KV heads")
        q, kv = _head_rows(spec, lo, hi)
        pieces = [norm, *matrix_pieces(index, i, "self_attn.q_proj", rows=(2 * q[0], 2 * q[1])),
                  *matrix_pieces(index, i, "self_attn.k_proj", rows=kv),
                  *matrix_pieces(index, i, "self_attn.v_proj", rows=kv),
                  *matrix_pieces(index, i, "self_attn.o_proj", cols=q)]  # fmt: skip
        pieces += [Piece(n, t[n]) for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight")]
        return Part(i, "attn", lo, hi, True, True, tuple(pieces))
    lin = spec.linear
    assert lin is not None
    channels, values, heads = linear_ranges(lin, shard)
    pieces = [norm]
    for tag, rows in zip(("", "k", "v"), channels, strict=True):
        pieces += matrix_pieces(index, i, "linear_attn.in_proj_qkv", rows=rows, tag=tag)
        key = "linear_attn.conv1d" + (f"@{tag}" if tag else "")
        pieces.append(Piece(f"{key}.weight", t["linear_attn.conv1d.weight"], rows=rows))
    pieces += matrix_pieces(index, i, "linear_attn.in_proj_z", rows=values)
    for m in ("in_proj_b", "in_proj_a"):
        pieces += matrix_pieces(index, i, f"linear_attn.{m}", rows=heads)
    pieces += matrix_pieces(index, i, "linear_attn.out_proj", cols=values)
    pieces += [Piece(f"linear_attn.{n}", t[f"linear_attn.{n}"], rows=heads)
               for n in ("dt_bias", "A_log")]  # fmt: skip
    pieces.append(Piece("linear_attn.norm.weight", t["linear_attn.norm.weight"]))
    return Part(i, "linear", heads[0], heads[1], True, True, tuple(pieces))


Range = tuple[int, int]


def linear_ranges(lin: LinearSpec, shard: Shard) -> tuple[list[Range], Range, Range]:
    """A rank's share of a linear layer, by its key heads: (its channels of q, k and v in the
    conv's [C] (in_proj_qkv's rows), its value features, its value heads)."""
    a, b = shard.range(lin.num_k_heads, what="key heads")
    g, dk, dv, kd = lin.num_v_heads // lin.num_k_heads, lin.head_k_dim, lin.head_v_dim, lin.key_dim
    channels = [(a * dk, b * dk), (kd + a * dk, kd + b * dk),
                (2 * kd + a * g * dv, 2 * kd + b * g * dv)]  # fmt: skip
    return channels, (a * g * dv, b * g * dv), (a * g, b * g)


def _head_rows(spec: ModelSpec, lo: int, hi: int) -> tuple[Range, Range]:
    """KV heads [lo, hi)'s query features and key/value features."""
    width = spec.num_heads // spec.num_kv_heads * spec.head_dim
    return (lo * width, hi * width), (lo * spec.head_dim, hi * spec.head_dim)


def _mlp(index: ModelIndex, i: int) -> list[Part]:
    """The MLP whole: the dense one, or the router, the shared expert and the experts."""
    if not _sparse(index, i):
        return mlp_parts(index, i, 1, with_down=True)
    router, *experts = moe_parts(index, i)
    moe = index.spec.moe
    assert moe is not None
    if not moe.shared_intermediate_size:
        return [router, *experts]
    pieces = tuple(pc for m in SHARED for pc in matrix_pieces(index, i, m))
    shared = Part(i, "shared", 0, moe.shared_intermediate_size, True, True, pieces)
    return [router, shared, *experts]


def _dense_loads(index: ModelIndex, i: int, max_bytes: int, direct: bool) -> Groups:
    """The dense MLP whole if it fits, else gate/up row ranges, then down_proj's rows."""
    whole = mlp_parts(index, i, 1, with_down=True)
    if slot_size(whole, direct) <= max_bytes:
        return [whole]
    spec = index.spec
    first = _in_units(
        lambda g, u: mlp_parts(index, i, g, with_down=False, unit=u), spec.intermediate_size,
        row_unit(index, i, "mlp.gate_proj"), max_bytes, direct,
    )  # fmt: skip
    rows = _in_units(
        lambda g, u: out_row_parts(index, i, "down", g, u), spec.hidden_size,
        row_unit(index, i, "mlp.down_proj"), max_bytes, direct,
    )  # fmt: skip
    return None if first is None or rows is None else [[p] for p in first + rows]


def _gated_attention(
    p: Pass, h: torch.Tensor, state: LayerState, w: Mapping[str, torch.Tensor], lo: int, hi: int
) -> None:
    """The attention of KV heads [lo, hi) (all, or a rank's), gated: its K/V into the state,
    o_proj(heads · sigmoid(gate)) added into h [T, H] (summed over the ranks first). RoPE on
    each head's first `rot` dims (q [nh, T, D])."""
    spec, T = p.spec, h.shape[0]
    D, nkv = spec.head_dim, hi - lo
    nh = nkv * spec.num_heads // spec.num_kv_heads
    x = rms_norm(h, w["input_layernorm.weight"], spec.rms_norm_eps)
    qg = F.linear(x, w["self_attn.q_proj.weight"]).view(T, nh, 2 * D)
    gate = qg[..., D:].reshape(T, nh * D)
    q = rms_norm(qg[..., :D], w["self_attn.q_norm.weight"], spec.rms_norm_eps).transpose(0, 1)
    k = F.linear(x, w["self_attn.k_proj.weight"]).view(T, nkv, D)
    k = rms_norm(k, w["self_attn.k_norm.weight"], spec.rms_norm_eps).transpose(0, 1)
    v = F.linear(x, w["self_attn.v_proj.weight"]).view(T, nkv, D).transpose(0, 1)
    cos, sin = p.ropes["full"]
    rot = cos.shape[-1]
    q = q.contiguous()
    q[..., :rot] = apply_rope(q[..., :rot], cos, sin)
    k = k.contiguous()
    k[..., :rot] = apply_rope(k[..., :rot], cos, sin)
    state.k[0, lo:hi, p.start :] = k
    state.v[0, lo:hi, p.start :] = v
    q_chunk = T if fused_attention(h.device.type, h.element_size(), D) else p.chunk
    for c0 in range(0, T, q_chunk):
        c1 = min(T, c0 + q_chunk)
        heads = _attend(q, state, lo, hi, p.start, c0, c1, D**-0.5)  # [c, nh, D]
        out = heads.reshape(c1 - c0, nh * D) * torch.sigmoid(gate[c0:c1])
        if p.reduce is None:
            h[c0:c1].addmm_(out, w["self_attn.o_proj.weight"].t())
        else:
            h[c0:c1] += p.reduce(out @ w["self_attn.o_proj.weight"].t())


def _shared(p: Pass, w: Mapping[str, torch.Tensor], state: LayerState) -> None:
    """The shared expert on every token, scaled by sigmoid(gate · x), into the router's
    float32 sum (the experts' last part adds it into h)."""
    assert isinstance(state, MoeState) and state.routes is not None and state.x_norm is not None
    x, out = state.x_norm, state.routes.out
    for c0 in range(0, x.shape[0], p.chunk):
        xc = x[c0 : c0 + p.chunk]  # [c, H]
        act = F.silu(F.linear(xc, w["mlp.shared_expert.gate_proj.weight"]))
        act.mul_(F.linear(xc, w["mlp.shared_expert.up_proj.weight"]))
        y = F.linear(act, w["mlp.shared_expert.down_proj.weight"])  # [c, H]
        scale = torch.sigmoid(F.linear(xc, w["mlp.shared_expert_gate.weight"]))  # [c, 1]
        out[c0 : c0 + p.chunk] += (scale * y).float()


class _Offset(Mapping[str, torch.Tensor]):
    """A part's weights with the offset norms' weights plus `offset` (a Hugging Face
    checkpoint's, stored less one), in the weight's dtype; the others as they are."""

    def __init__(self, weights: Mapping[str, torch.Tensor], offset: float) -> None:
        self._w, self._offset = weights, offset

    def __getitem__(self, key: str) -> torch.Tensor:
        weight = self._w[key]
        return weight + self._offset if self._offset and key in OFFSET_NORMS else weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)
