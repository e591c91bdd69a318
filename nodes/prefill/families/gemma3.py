"""Gemma 3 (`gemma3_text`): the dense layer with Gemma's differences, as mlx-lm's
`gemma3_text` computes them:

- the embedded rows are scaled by sqrt(hidden), rounded to bfloat16 as mlx-lm rounds it;
- every RMSNorm scales by (1 + weight); q and k are RMS-normed per head;
- four norms per layer: `input_layernorm` before attention, `post_attention_layernorm` on
  the attention's output before it joins the residual, `pre_feedforward_layernorm` before the
  MLP, `post_feedforward_layernorm` on its output;
- scores scaled by query_pre_attn_scalar^-1/2; a GELU-tanh gate;
- "sliding" layers attend to the last `window` positions (their own included), with RoPE
  base `rope_local_theta`; "full" (global) layers to all, with `rope_theta` and its scaling.

Loads: the dense family's cuts (the tensor names are the same), each norm in the part that
uses it: `pre_feedforward_layernorm` where the dense MLP's first part holds its norm, the post
norms in the part that finishes the branch's output (the whole op, or its last row range). A
cut o_proj or down_proj adds its rows into a kept branch [T, H] (a norm needs all columns),
normed into the residual by the last range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.spec import LayerKind
from tandem.nodes.prefill.families.base import Groups, Pass, Weights
from tandem.nodes.prefill.families.llama import DenseFamily, dequantized
from tandem.nodes.prefill.kernels.blocks import LayerState, attention_part, mlp_part
from tandem.nodes.prefill.kernels.rope import inv_freq, rms_norm, rope_tables
from tandem.nodes.prefill.planning.loads import Part, Piece, slot_size
from tandem.nodes.prefill.prefix_upload import KV, State
from tandem.nodes.prefill.ranks.shard import Shard

PRE_FF = "pre_feedforward_layernorm.weight"
POST_ATTN = "post_attention_layernorm.weight"
POST_FF = "post_feedforward_layernorm.weight"


@dataclass
class Gemma3State(LayerState):
    branch: torch.Tensor | None = None  # [T, H]: a cut o/down's output before its post norm


class Gemma3Family(DenseFamily):
    name = "gemma3"
    State = Gemma3State

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        """The dense cuts with room for the two norms they lack, as much as they take."""
        slack = 0
        while True:
            groups = super().layer_groups(index, layer, max_bytes - slack, direct)
            if groups is None:
                return None
            groups = [_with_norms(index, group) for group in groups]
            worst = max(slot_size(group, direct) for group in groups)
            if worst <= max_bytes:
                return groups
            slack += worst - max_bytes

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        return _with_norms(index, super().whole_layer(index, layer))

    def shard_layer(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        return _with_norms(index, super().shard_layer(index, layer, shard))

    def begin(self, p: Pass, h: torch.Tensor) -> Pass:
        """Scale the embedded rows h [T, H] in place (mlx-lm: by sqrt(hidden) rounded to
        bfloat16, in the model dtype) and add the sliding layers' RoPE tables."""
        spec = p.spec
        h.mul_(torch.tensor(spec.hidden_size**0.5, dtype=torch.bfloat16).item())
        if spec.rope_local_theta is None:
            return p
        local = dataclasses.replace(spec, rope_theta=spec.rope_local_theta, rope_scaling=None)
        tables = rope_tables(inv_freq(local), p.start, h.shape[0], h.device)
        return dataclasses.replace(p, ropes={"sliding": tables})

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        spec, kind = p.spec, p.spec.layer_kinds[part.layer]
        w = _OnePlusNorms(dequantized(p, part, weights))
        if part.op in ("o", "down"):
            assert isinstance(state, Gemma3State)
            if part.first:
                state.branch = torch.zeros_like(h)
            assert state.branch is not None
            super().compute(p, part, weights, state.branch, state)  # rows into the branch
            if part.last:
                norm = w[POST_ATTN if part.op == "o" else POST_FF]
                for c0 in range(0, h.shape[0], p.chunk):
                    rows = slice(c0, c0 + p.chunk)
                    h[rows] += rms_norm(state.branch[rows], norm, spec.rms_norm_eps)
                state.branch = None
            return False
        if part.op in ("attn", "qkv"):
            whole = part.op == "attn"
            attention_part(
                spec, h, state, w, part.lo, part.hi, part.first, p.start, p.rope_of(kind),
                p.chunk, with_o=whole, window=kind.window,
                post_norm=w[POST_ATTN] if whole else None, reduce=p.reduce,
            )  # fmt: skip
            return part.last  # the layer's K/V are final: the MLP does not touch them
        whole = part.op == "mlp"
        mlp_part(spec, h, state, w, part.first, p.chunk, part.lo, part.hi, with_down=whole,
                 norm=PRE_FF, post_norm=w[POST_FF] if whole else None,
                 reduce=p.reduce)  # fmt: skip
        return False

    def handover(self, p: Pass, kind: LayerKind, layer: int, state: LayerState) -> KV | State:
        """A sliding layer hands over all K/V of the new positions, as a full layer does: the
        node's prefix cache keeps them (a later turn's band reaches back into them), and
        only the last `window` of them cross the wire, in float (`prefix_cache.reusing`,
        `Header.positions`)."""
        if kind.kind == "sliding":
            return state.k[:, :, p.start :], state.v[:, :, p.start :]
        return super().handover(p, kind, layer, state)


def _with_norms(index: ModelIndex, parts: list[Part]) -> list[Part]:
    """Dense `parts` of one layer with Gemma's norms where they are used."""
    t = index.layers[parts[0].layer]
    out = []
    for part in parts:
        pieces = list(part.pieces)
        if part.op in ("mlp", "gate_up") and part.first:  # its input norm: Gemma's own
            pieces = [Piece(PRE_FF, t[PRE_FF]) if pc.key == POST_ATTN else pc for pc in pieces]
        if part.op == "attn" or (part.op == "o" and part.last):
            pieces.append(Piece(POST_ATTN, t[POST_ATTN]))
        if part.op == "mlp" or (part.op == "down" and part.last):
            pieces.append(Piece(POST_FF, t[POST_FF]))
        out.append(dataclasses.replace(part, pieces=tuple(pieces)))
    return out


class _OnePlusNorms(Mapping[str, torch.Tensor]):
    """A part's weights with each RMSNorm's as Gemma scales by it: 1 + weight (in the
    weight's dtype, as mlx-lm adds it); the others as they are, asked for when used."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._w = weights

    def __getitem__(self, key: str) -> torch.Tensor:
        weight = self._w[key]
        return 1.0 + weight if key.endswith("norm.weight") else weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)
