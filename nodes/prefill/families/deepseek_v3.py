"""DeepSeek V3 (`deepseek_v3`; Kimi K2's `kimi_k2` is the same): multi-head latent attention
(`kernels/mla.py`) on every layer, then the lineage's MLP: dense in the first layers, else the
noaux_tc router, the shared experts and the routed experts (GLM-4.x MoE's, `deepseek_moe.py`).

A latent layer keeps per position its normed latent and its roped key (the layer kind
"latent"): its state's `k` [1, 1, S, kv_lora] and `v` [1, 1, S, rope], which it hands over as a
full layer hands over K/V, and which a prefix gives back. Loads: the attention is one part (its
pieces: q's low-rank pair or q_proj, the latent's down- and up-projections, o_proj), never cut:
DeepSeek V3's is ≈ 0.37 GB in bf16, well under any slot; the MLP as the lineage cuts it.
"""

from __future__ import annotations

import dataclasses

import torch
from tandem.nodes.model.deepseek_config import MlaSpec
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.spec import LayerKind
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.families.base import Groups, Pass, Weights
from tandem.nodes.prefill.families.deepseek_moe import NoauxMoeFamily
from tandem.nodes.prefill.families.llama import dequantized, matrix_pieces
from tandem.nodes.prefill.kernels.blocks import LayerState
from tandem.nodes.prefill.kernels.mla import mla_attention
from tandem.nodes.prefill.kernels.rope import inv_freq, rope_mscale, rope_tables
from tandem.nodes.prefill.planning.loads import Part, Piece
from tandem.nodes.prefill.prefix_upload import KV, Prefix, State
from tandem.nodes.prefill.ranks.shard import Shard

_NORMS = ("input_layernorm.weight", "self_attn.q_a_layernorm.weight",
          "self_attn.kv_a_layernorm.weight")  # fmt: skip
_MATRICES = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.q_proj",
             "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.embed_q",
             "self_attn.unembed_out", "self_attn.o_proj")  # fmt: skip
_BIASES = ("self_attn.q_a_proj.bias", "self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias")


class DeepseekV3Family(NoauxMoeFamily):
    name = "deepseek_v3"

    def attention_loads(
        self, index: ModelIndex, layer: int, max_bytes: int, direct: bool
    ) -> Groups:
        """The latent attention whole, in one load."""
        return [[attention_part(index, layer)]]

    def attention_parts(self, index: ModelIndex, layer: int) -> list[Part]:
        return [attention_part(index, layer)]

    def shard_attention(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        """The rank's heads: the latent's (and q's low-rank) down-projections on every rank,
        its heads' rows of the up-projections, o_proj's columns for them."""
        mla = index.spec.mla
        assert mla is not None
        return [attention_part(index, layer, shard.range(index.spec.num_heads, what="heads"), mla)]

    def begin(self, p: Pass, h: torch.Tensor) -> Pass:
        """The rope key's tables: over qk_rope_head_dim, pair by pair (cos, sin [T, rope/2]),
        with YaRN's mscale folded in where it is not 1."""
        spec = p.spec
        assert spec.mla is not None
        rotary = dataclasses.replace(spec, head_dim=spec.mla.rope_dim)
        cos, sin = rope_tables(inv_freq(rotary), p.start, h.shape[0], h.device)
        half, m = spec.mla.rope_dim // 2, rope_mscale(spec)
        return dataclasses.replace(p, ropes={"latent": (cos[:, :half] * m, sin[:, :half] * m)})

    def new_state(
        self, p: Pass, kind: LayerKind, layer: int, count: int, prefix: Prefix | None
    ) -> LayerState:
        """The latents [1, 1, S, kv_lora] and rope keys [1, 1, S, rope], the prefix's first."""
        mla, device = p.spec.mla, p.scratch.device
        assert mla is not None
        total = p.start + count
        latent = torch.empty(1, 1, total, mla.kv_lora_rank, dtype=p.dtype, device=device)
        rope = torch.empty(1, 1, total, mla.rope_dim, dtype=p.dtype, device=device)
        if p.start:
            if not isinstance(prefix, tuple):
                raise PrefillError(f"layer {layer}: a latent layer's prefix is not its latents")
            pk, pv = prefix
            if (tuple(pk.shape), tuple(pv.shape)) != (latent[:, :, : p.start].shape,
                                                      rope[:, :, : p.start].shape):  # fmt: skip
                raise PrefillError(f"prefix of layer {layer} has shapes {tuple(pk.shape)}")
            latent[:, :, : p.start] = pk.to(device, p.dtype)
            rope[:, :, : p.start] = pv.to(device, p.dtype)
        return self.State(latent, rope)

    def compute_attention(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        w = dequantized(p, part, weights)
        mla_attention(p.spec, h, state, w, p.start, p.ropes["latent"], p.chunk, p.reduce)
        return True  # the layer's latents are final

    def handover(self, p: Pass, kind: LayerKind, layer: int, state: LayerState) -> KV | State:
        """The latents and rope keys of the new positions (every rank computes them alike:
        rank 0's cross, the others' are summed in as zeros)."""
        k, v = state.k[:, :, p.start :], state.v[:, :, p.start :]
        return (k, v) if p.shard.rank == 0 else (torch.zeros_like(k), torch.zeros_like(v))


def attention_part(
    index: ModelIndex, i: int, heads: tuple[int, int] | None = None, mla: MlaSpec | None = None
) -> Part:
    """Layer i's latent attention as one "attn" part (its input norm included); of `heads`
    [a, b) only (a rank's: `mla` their widths), its up-projections' rows and o_proj's columns
    for them."""
    t = index.layers[i]
    pieces: list[Piece] = [Piece(n, t[n]) for n in _NORMS if n in t]
    for module in _MATRICES:
        if f"{module}.weight" in t:
            rows, cols = _head_share(module, heads, mla)
            pieces += matrix_pieces(index, i, module, rows=rows, cols=cols)
    pieces += [Piece(n, t[n]) for n in _BIASES if n in t]
    return Part(i, "attn", 0, 1, True, True, tuple(pieces))


def _head_share(
    module: str, heads: tuple[int, int] | None, mla: MlaSpec | None
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(rows, cols) of `module` that heads [a, b) use; (None, None): all of it."""
    if heads is None or mla is None:
        return None, None
    a, b = heads
    per_head = {  # rows a head owns
        "self_attn.q_b_proj": mla.q_dim, "self_attn.q_proj": mla.q_dim,
        "self_attn.kv_b_proj": mla.nope_dim + mla.v_dim,
        "self_attn.embed_q": 1, "self_attn.unembed_out": 1,  # [nh, ...]: a head a row
    }  # fmt: skip
    if module in per_head:
        return (a * per_head[module], b * per_head[module]), None
    if module == "self_attn.o_proj":
        return None, (a * mla.v_dim, b * mla.v_dim)
    return None, None  # the down-projections: every rank's
