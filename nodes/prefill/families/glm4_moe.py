"""GLM-4.x MoE (`glm4_moe`: GLM-4.5, 4.5-Air, 4.6, 4.7), as mlx-lm's `glm4_moe.py` computes it:
the dense family's attention, with the lineage's MLP (`deepseek_moe.py`: dense first layers,
the noaux_tc router, shared and routed experts).

The attention is GQA with q/k/v biases (`attention_bias`), per-head q/k RMSNorm where
`use_qk_norm`, and RoPE on the first int(head_dim · `partial_rotary_factor`) dims of each head
only (`begin`: the tables cover those dims; `apply_rope` passes the others), so it is cut as
the dense family cuts it (KV-head groups, o_proj rows).
"""

from __future__ import annotations

import dataclasses

import torch
from tandem.nodes.prefill.families.base import Pass
from tandem.nodes.prefill.families.deepseek_moe import NoauxMoeFamily
from tandem.nodes.prefill.kernels.rope import inv_freq, rope_tables


class Glm4MoeFamily(NoauxMoeFamily):
    name = "glm4_moe"

    def begin(self, p: Pass, h: torch.Tensor) -> Pass:
        """RoPE tables over the rotary dims only (mlx-lm's `nn.RoPE(int(D · factor))`)."""
        spec = p.spec
        rotary = dataclasses.replace(spec, head_dim=int(spec.head_dim * spec.partial_rotary_factor))
        return dataclasses.replace(
            p, rope=rope_tables(inv_freq(rotary), p.start, h.shape[0], h.device)
        )
