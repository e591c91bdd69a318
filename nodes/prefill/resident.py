"""A quantized model's resident matrices, dequantized once (the plan's "dequantized"
resident form, `loads.resident_form`): a resident load's weight views with each quantized
matrix replaced by its float form in the compute dtype, made the first time the load computes
and kept beside its packed bytes (the plan counts them). Compute then takes a float view as it
is: no pass dequantizes a resident matrix again."""

from __future__ import annotations

import math

import torch
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.prefill.kernels.dequant import dequantize
from tandem.nodes.prefill.planning.loads import ALIGN, Load


class ResidentFloats:
    def __init__(self, index: ModelIndex, dtype: torch.dtype, scratch: torch.Tensor) -> None:
        self.index, self.dtype = index, dtype
        self.scratch = scratch  # free when a load is made: the temporaries' room
        self._made: dict[int, dict[str, torch.Tensor]] = {}  # load seq → its views

    def views(self, load: Load, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`load`'s views (keyed `op:lo:name`), its quantized matrices in float."""
        if load.seq not in self._made:
            self._made[load.seq] = self._make(load, views)
        return self._made[load.seq]

    def _make(self, load: Load, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(views)
        for part in load.parts:
            at = f"{part.op}:{part.lo}:"
            for piece in part.pieces:
                module = piece.key.removesuffix(".weight")
                quant = self.index.quant(part.layer, module)
                if quant is None or module == piece.key:
                    continue
                words = views[at + piece.key]
                scales = out.pop(at + f"{module}.scales")
                biases = out.pop(at + f"{module}.biases", None)  # none in an fp mode
                shape = (*scales.shape[:-1], scales.shape[-1] * quant.group_size)
                floats = _aligned(shape, self.dtype, words.device)
                if words.dim() == 3:  # stacked experts [E, out, words]: one by one
                    for e in range(words.shape[0]):
                        dequantize(words[e], scales[e], None if biases is None else biases[e],
                                   quant, self.dtype, floats[e], self.scratch)  # fmt: skip
                else:
                    dequantize(words, scales, biases, quant, self.dtype, floats, self.scratch)
                out[at + piece.key] = floats
        return out


def _aligned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor starting on an `ALIGN` boundary (torch's CPU allocator gives 64)."""
    nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device)
    return raw[-raw.data_ptr() % ALIGN :][:nbytes].view(dtype).view(shape)
