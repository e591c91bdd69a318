"""A load's chosen experts at once (issue 48 item 4): one gather of the tokens routed to them,
each matrix of theirs stacked (a view where the slot lays them out evenly; MLX-quantized ones
dequantized in one call), three grouped GEMMs (`torch._grouped_mm`; a padded `bmm` where the
device has none), one scatter of the weighted outputs. A few dozen aten ops per load whatever
the number of experts chosen, where expert by expert took ~12 each (float) or ~33 (4-bit):
≈74k / 203k ops per pass for a Qwen3-30B-A3B at 4k tokens, ≈0.7 / 2.1 s of host time on a GPU.

Experts go in chunks only where the scratch cannot hold all of their dequantized matrices
(a tight budget plans room for one expert: `plan._scratch`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tandem.nodes.prefill.kernels.dequant import aligned_front, dequantize, temp_bytes_per_row
from tandem.nodes.prefill.planning.loads import ALIGN, Part, round_up

if TYPE_CHECKING:  # the families import this module: a type only, not at run time
    from tandem.nodes.prefill.families.base import Pass

Views = Mapping[str, torch.Tensor]  # a load's weight views, keyed `op:lo:name`


def compute_experts(
    p: Pass, parts: Sequence[Part], views: Views, state: Any, h: torch.Tensor
) -> None:
    """The experts of `parts` (a load's, in order) on the tokens routed to them, their
    weighted outputs added into the routes' float32 sum; the layer's last expert adds the sum
    into h."""
    in_chunks(p, parts, views, state, h, _fit, _chunk)


Fit = Callable[[Any, Sequence[Part], Views], int]  # how many chosen experts go at once
Chunk = Callable[[Any, Sequence[Part], Views, Any, torch.Tensor], None]  # them, computed


def in_chunks(
    p: Pass, parts: Sequence[Part], views: Views, state: Any, h: torch.Tensor, fit: Fit,
    chunk: Chunk,
) -> None:  # fmt: skip
    """A load's chosen experts (those with tokens), `fit` at a time through `chunk`, into the
    routes' float32 sum; the layer's last expert (a rank's last: summed over the ranks first,
    `ranks/`) adds the sum into h."""
    r, x = state.routes, state.x_norm
    assert r is not None and x is not None
    chosen = [pt for pt in parts if r.starts[pt.lo + 1] > r.starts[pt.lo]]
    at_once = fit(p, chosen, views)
    for k in range(0, len(chosen), at_once):
        chunk(p, chosen[k : k + at_once], views, r, x)
    if parts[-1].last:
        h += (r.out if p.reduce is None else p.reduce(r.out)).to(h.dtype)
        state.routes, state.x_norm = None, None


def _chunk(p: Pass, chosen: Sequence[Part], views: Views, r: Any, x: torch.Tensor) -> None:
    """Experts `chosen` (each with tokens, ascending) at once."""
    a, b = r.starts[chosen[0].lo], r.starts[chosen[-1].lo + 1]
    entries = r.order[a:b]  # their (token, slot) entries, by expert: no other expert's between
    rows = entries // r.k
    counts = [r.starts[pt.lo + 1] - r.starts[pt.lo] for pt in chosen]
    xs = x[rows]  # [N, H]
    act = F.silu(_grouped(xs, _stacked(p, views, chosen, "gate_proj"), counts))  # [N, I]
    act.mul_(_grouped(xs, _stacked(p, views, chosen, "up_proj"), counts))
    y = _grouped(act, _stacked(p, views, chosen, "down_proj"), counts).float()  # [N, H]
    r.out.index_add_(0, rows, y * r.weights[entries].float()[:, None])


def _tensors(p: Pass, views: Views, part: Part, m: str) -> tuple[torch.Tensor, ...]:
    """Expert `part.lo`'s `m` matrix: (float [out, in],) or (words, scales, biases), the
    biases None in an fp mode."""
    at = f"experts:{part.lo}:"
    if at + "mlp.experts.gate_up_proj" in views:  # fused (float): gate rows, then up rows
        if m == "down_proj":
            return (views[at + "mlp.experts.down_proj"][0],)
        gate_up = views[at + "mlp.experts.gate_up_proj"][0]  # [2I, H]
        half = gate_up.shape[0] // 2
        return (gate_up[:half] if m == "gate_proj" else gate_up[half:],)
    stacked = at + f"mlp.switch_mlp.{m}.weight" in views
    module = f"mlp.switch_mlp.{m}" if stacked else f"mlp.experts.{part.lo}.{m}"
    words = views[at + f"{module}.weight"]
    words = words[0] if stacked else words
    quant = p.index.quant(part.layer, module)
    if quant is None or words.is_floating_point():  # float, or kept dequantized
        return (words,)
    pick = (lambda t: t[0]) if stacked else (lambda t: t)
    biases = views.get(at + f"{module}.biases")
    return words, pick(views[at + f"{module}.scales"]), None if biases is None else pick(biases)


def _stacked(p: Pass, views: Views, chosen: Sequence[Part], m: str) -> torch.Tensor:
    """The chosen experts' `m` matrices [c, out, in] in the compute dtype."""
    each = [_tensors(p, views, pt, m) for pt in chosen]
    if len(each[0]) == 1:
        return _stack([t[0] for t in each])
    words, scales = (torch.stack([t[i] for t in each]) for i in range(2))
    biases = torch.stack([t[2] for t in each]) if each[0][2] is not None else None
    c, rows = words.shape[:2]
    quant = p.index.quant(chosen[0].layer, _module(views, chosen[0], m))
    assert quant is not None
    cols = scales.shape[-1] * quant.group_size
    nbytes = c * rows * cols * torch.finfo(p.dtype).bits // 8
    dest = aligned_front(p.scratch, nbytes)
    into = dest[:nbytes].view(p.dtype).view(c * rows, cols)
    flat = None if biases is None else biases.view(c * rows, -1)
    dequantize(words.view(c * rows, -1), scales.view(c * rows, -1), flat, quant, p.dtype, into,
               dest[round_up(nbytes, ALIGN) :])  # fmt: skip
    return into.view(c, rows, cols)


def _module(views: Views, part: Part, m: str) -> str:
    at = f"experts:{part.lo}:"
    return f"mlp.switch_mlp.{m}" if at + f"mlp.switch_mlp.{m}.weight" in views else (
        f"mlp.experts.{part.lo}.{m}"
    )  # fmt: skip


def _stack(mats: list[torch.Tensor]) -> torch.Tensor:
    """[c, out, in]: a view where the matrices lie evenly apart in one storage (a load's
    experts of one size, laid out in turn), else a stacked copy."""
    first = mats[0]
    if len(mats) == 1:
        return first.unsqueeze(0)
    step = mats[1].data_ptr() - first.data_ptr()
    even = step > 0 and step % first.element_size() == 0 and all(
        m.shape == first.shape and m.stride() == first.stride()
        and m.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and m.data_ptr() - first.data_ptr() == i * step
        for i, m in enumerate(mats)
    )  # fmt: skip
    if not even:
        return torch.stack(mats)
    return first.as_strided((len(mats), *first.shape), (step // first.element_size(),
                                                        *first.stride()))  # fmt: skip


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Rows of `x` [N, in], `counts[j]` of them for matrix j of `w` [c, out, in] in turn, each
    times its matrix's transpose: [N, out]."""
    if _grouped_mm_on(x.device.type, x.dtype):
        offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
        return torch._grouped_mm(x, w.transpose(-1, -2), offs=offs.to(x.device))
    most, c = max(counts), len(counts)
    # each group's rows at the top of its [most] block, the rest padding (a zero row)
    at = [j * most + i for j, n in enumerate(counts) for i in range(n)]
    place = torch.tensor(at, dtype=torch.int64).to(x.device)
    padded = x.new_zeros(c * most, x.shape[1]).index_copy_(0, place, x)
    out = torch.bmm(padded.view(c, most, -1), w.transpose(-1, -2))  # [c, most, out]
    return out.view(c * most, -1).index_select(0, place)


@functools.cache
def _grouped_mm_on(device: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here: the CPU (torch 2.13), a CUDA card of compute
    capability 9.0 or later; tried once on a tiny problem."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        return False
    try:
        a = torch.zeros(2, 16, dtype=dtype, device=device)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=device)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _fit(p: Pass, chosen: Sequence[Part], views: Views) -> int:
    """How many of the chosen experts go at once: all of them for float experts; for
    quantized ones, as many as the scratch holds one matrix of (with its temporaries)."""
    if not chosen:
        return 1
    words = _tensors(p, views, chosen[0], "gate_proj")
    if len(words) == 1:
        return len(chosen)
    quant = p.index.quant(chosen[0].layer, _module(views, chosen[0], "gate_proj"))
    assert quant is not None
    per_expert = 0
    for m in ("gate_proj", "up_proj", "down_proj"):
        _, s, _ = _tensors(p, views, chosen[0], m)
        rows, cols = s.shape[0], s.shape[-1] * quant.group_size
        floats = round_up(rows * cols * torch.finfo(p.dtype).bits // 8, ALIGN)
        per_row = temp_bytes_per_row(cols, quant.bits, s.dtype, p.dtype)
        per_expert = max(per_expert, floats + rows * per_row)
    return max(1, min(len(chosen), p.scratch.numel() // per_expert))


# what the other families' expert kernels share (`experts_oai.py`)
grouped_matmul = _grouped
stack_views = _stack
