"""gpt-oss's experts, a load's chosen ones at once (as `experts.py` does for Qwen's): one
gather of the tokens routed to them, each projection's matrices stacked (a view where the slot
lays them out evenly; MLX-quantized ones, MXFP4 included, dequantized in one call), grouped
GEMMs, one scatter of the weighted outputs.

What differs from Qwen's SwiGLU experts (mlx-lm's `SwitchGLU(bias=True, SwigluOAI())`):
- every projection has a bias per expert, added to its rows;
- the activation: gate clamped from above at 7, up clamped to [-7, 7],
  (up + 1) · gate · sigmoid(1.702 · gate);
- OpenAI's layout fuses gate and up into one [2I, H] matrix per expert, gate rows even and up
  rows odd: one GEMM, its output's even and odd columns.

Shapes: N = the chunk's routed (token, expert) entries, H = hidden, I = an expert's width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tandem.nodes.model.gpt_oss_config import SWIGLU_ALPHA, SWIGLU_LIMIT
from tandem.nodes.prefill.kernels.dequant import aligned_front, dequantize, temp_bytes_per_row
from tandem.nodes.prefill.kernels.experts import grouped_matmul, in_chunks, stack_views
from tandem.nodes.prefill.planning.loads import ALIGN, Part, round_up

if TYPE_CHECKING:
    from tandem.nodes.prefill.families.base import Pass

Views = Mapping[str, torch.Tensor]
EXPERTS = "mlp.experts."


def compute_oai_experts(
    p: Pass, parts: Sequence[Part], views: Views, state: Any, h: torch.Tensor
) -> None:
    """The experts of `parts` on the tokens routed to them, weighted into the routes' float32
    sum; the layer's last expert adds the sum into h [T, H]."""
    in_chunks(p, parts, views, state, h, _fit, _chunk)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """mlx-lm's `swiglu_oai`, in the inputs' dtype (gate and up [N, I]): in place in gate."""
    gate = gate.clamp_(max=SWIGLU_LIMIT)
    up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT).add_(1.0)
    return gate.mul_(torch.sigmoid(gate * SWIGLU_ALPHA)).mul_(up)


def _chunk(p: Pass, chosen: Sequence[Part], views: Views, r: Any, x: torch.Tensor) -> None:
    """Experts `chosen` (each with tokens, ascending) at once."""
    a, b = r.starts[chosen[0].lo], r.starts[chosen[-1].lo + 1]
    entries = r.order[a:b]  # their (token, slot) entries, by expert
    rows = entries // r.k
    counts = [r.starts[pt.lo + 1] - r.starts[pt.lo] for pt in chosen]
    which = torch.repeat_interleave(
        torch.arange(len(chosen), device=x.device),
        torch.tensor(counts, device=x.device),
        output_size=b - a,
    )  # [N]: each entry's place among the chosen
    xs = x[rows]  # [N, H]
    if EXPERTS + "gate_up_proj.weight" in _names(views, chosen[0]):  # OpenAI's fused layout
        gu = _project(p, views, chosen, "gate_up_proj", xs, counts, which)  # [N, 2I]
        act = swiglu_oai(gu[:, 0::2], gu[:, 1::2]).contiguous()  # [N, I]: the even columns
    else:
        gate = _project(p, views, chosen, "gate_proj", xs, counts, which)
        act = swiglu_oai(gate, _project(p, views, chosen, "up_proj", xs, counts, which))
    y = _project(p, views, chosen, "down_proj", act, counts, which).float()  # [N, H]
    r.out.index_add_(0, rows, y * r.weights[entries].float()[:, None])


def _names(views: Views, part: Part) -> frozenset[str]:
    at = f"experts:{part.lo}:"
    return frozenset(k.removeprefix(at) for k in views if k.startswith(at))


def _project(
    p: Pass, views: Views, chosen: Sequence[Part], proj: str, xs: torch.Tensor,
    counts: Sequence[int], which: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """xs [N, in] through each entry's expert's `proj` with its bias: [N, out]."""
    module = EXPERTS + proj
    out = grouped_matmul(xs, _matrices(p, views, chosen, module), counts)
    bias = stack_views([views[f"experts:{pt.lo}:{module}.bias"][0] for pt in chosen])  # [c, out]
    return out.add_(bias.to(out.dtype)[which])


def _matrices(p: Pass, views: Views, chosen: Sequence[Part], module: str) -> torch.Tensor:
    """The chosen experts' `module` matrices [c, out, in] in the compute dtype (quantized
    ones dequantized into the front of the scratch)."""

    def each(name: str) -> list[torch.Tensor]:
        return [views[f"experts:{pt.lo}:{module}.{name}"][0] for pt in chosen]

    words = each("weight")
    quant = p.index.quant(chosen[0].layer, module)
    if quant is None or words[0].is_floating_point():
        return stack_views(words)
    scales = torch.stack(each("scales"))
    has_biases = f"experts:{chosen[0].lo}:{module}.biases" in views  # affine only
    biases = torch.stack(each("biases")) if has_biases else None
    stacked = torch.stack(words)
    c, rows = stacked.shape[:2]
    cols = scales.shape[-1] * quant.group_size
    nbytes = c * rows * cols * torch.finfo(p.dtype).bits // 8
    dest = aligned_front(p.scratch, nbytes)
    into = dest[:nbytes].view(p.dtype).view(c * rows, cols)
    flat = None if biases is None else biases.view(c * rows, -1)
    dequantize(stacked.view(c * rows, -1), scales.view(c * rows, -1), flat, quant, p.dtype,
               into, dest[round_up(nbytes, ALIGN) :])  # fmt: skip
    return into.view(c, rows, cols)


def _fit(p: Pass, chosen: Sequence[Part], views: Views) -> int:
    """How many of the chosen experts go at once: all of them where they are float; else as
    many as the scratch holds one (the largest) matrix of, with its temporaries."""
    if not chosen:
        return 1
    per_expert = 0
    for name in _names(views, chosen[0]):
        module = name.removesuffix(".weight")
        quant = p.index.quant(chosen[0].layer, module)
        words = views[f"experts:{chosen[0].lo}:{name}"]
        if not name.endswith(".weight") or quant is None or words.is_floating_point():
            continue
        scales = views[f"experts:{chosen[0].lo}:{module}.scales"]
        rows, cols = scales.shape[-2], scales.shape[-1] * quant.group_size
        floats = round_up(rows * cols * torch.finfo(p.dtype).bits // 8, ALIGN)
        per_row = temp_bytes_per_row(cols, quant.bits, scales.dtype, p.dtype)
        per_expert = max(per_expert, floats + rows * per_row)
    if not per_expert:
        return len(chosen)
    return max(1, min(len(chosen), p.scratch.numel() // per_expert))
