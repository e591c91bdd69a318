"""The DeepSeek-V3 lineage's router (`topk_method: noaux_tc`), as mlx-lm's `group_expert_select`
computes it (`glm4_moe.py`, `deepseek_v3.py`).

Scores are sigmoid(logits) in float32. The correction bias is added for the choice only: with
`groups` > 1, each group of experts is scored by its best two biased scores, and all but the
best `topk_groups` groups are zeroed (set to 0.0, as mlx-lm does: not ruled out, so an expert
of a kept group whose biased score is below zero still loses to them; where a token's kept
groups hold fewer than k positive biased scores, the zeroed experts tie for the rest, and
which of them mlx-lm's argpartition takes is its own); then each token's top-k by biased
score. Their weights are the unbiased scores, renormalised to sum to 1 where
`norm_topk_prob` (and k > 1), times `routed_scaling`. Shapes: T = tokens, E = experts.
"""

from __future__ import annotations

import torch
from tandem.nodes.model.spec import MoeSpec


def noaux_select(
    logits: torch.Tensor, bias: torch.Tensor, moe: MoeSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts [T, k] (int64) and their weights [T, k] (float32), from the
    router's logits [T, E] (any float dtype) and the correction bias [E]."""
    scores = torch.sigmoid(logits.float())  # [T, E]
    biased = scores + bias.float()
    if moe.groups > 1:
        T, G = biased.shape[0], moe.groups
        grouped = biased.view(T, G, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        drop = group_scores.topk(G - moe.topk_groups, dim=-1, largest=False).indices
        grouped = grouped.scatter(1, drop[..., None].expand(-1, -1, grouped.shape[-1]), 0.0)
        biased = grouped.view(T, -1)
    k = moe.experts_per_token
    experts = biased.topk(k, dim=-1).indices  # [T, k]
    weights = scores.gather(-1, experts)
    if k > 1 and moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights * moe.routed_scaling
