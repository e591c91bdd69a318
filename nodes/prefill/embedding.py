"""The prompt's embedding rows, and only those: read from disk row by row (the table is never
loaded), a quantized table's rows dequantized after the gather."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.prefill.kernels.dequant import dequantize
from tandem.nodes.prefill.stream.streamer import TORCH_DTYPES

TABLE = "model.embed_tokens"


class Embedding:
    def __init__(
        self, index: ModelIndex, device: torch.device, dtype: torch.dtype, scratch: torch.Tensor
    ) -> None:
        self.index, self.device, self.dtype, self.scratch = index, device, dtype, scratch
        self._fd = os.open(index.globals[f"{TABLE}.weight"].file, os.O_RDONLY)

    def __call__(self, tokens: Sequence[int]) -> torch.Tensor:
        """[T, H] on the device, in the compute dtype (mlx-lm's embedding dequantizes in the
        scales' dtype, whatever the model computes in; an fp mode's, whose scales are bytes,
        in bfloat16: `mx.dequantize`'s default)."""
        weight = self._rows(f"{TABLE}.weight", tokens)
        quant = self.index.global_quant(TABLE)
        if quant is None:
            return weight.to(self.device, non_blocking=True).to(self.dtype)
        scales = self._rows(f"{TABLE}.scales", tokens).to(self.device, non_blocking=True)
        biases = None
        if quant.biases:
            biases = self._rows(f"{TABLE}.biases", tokens).to(self.device, non_blocking=True)
        words = weight.to(self.device, non_blocking=True)
        dtype = scales.dtype if quant.biases else torch.bfloat16
        rows = dequantize(words, scales, biases, quant, dtype, temp=self.scratch)
        return rows.to(self.dtype)

    def _rows(self, name: str, tokens: Sequence[int]) -> torch.Tensor:
        """Rows `tokens` of a global 2-D tensor, read from disk: [T, cols] on the host."""
        e = self.index.globals[name]
        fd = self._fd
        if e.file != self.index.globals[f"{TABLE}.weight"].file:
            fd = os.open(e.file, os.O_RDONLY)
        row = e.nbytes // e.shape[0]
        # on CUDA read into pinned memory: its copy to the device then does not hold the
        # thread (from pageable memory it was synchronous; issue 48)
        pin = self.device.type == "cuda"
        rows = torch.empty((len(tokens), e.shape[1]), dtype=TORCH_DTYPES[e.dtype], pin_memory=pin)
        buf = memoryview(rows.view(torch.uint8).numpy()).cast("B")
        try:
            for t in set(tokens):  # queue every row's read at once (cold: random 1-row reads)
                os.posix_fadvise(fd, e.offset + t * row, row, os.POSIX_FADV_WILLNEED)
            for i, t in enumerate(tokens):
                n = os.preadv(fd, [buf[i * row : (i + 1) * row]], e.offset + t * row)
                if n != row:
                    raise ModelError(f"{e.file}: short read in {name}")
        finally:
            if fd != self._fd:
                os.close(fd)
        return rows

    def close(self) -> None:
        os.close(self._fd)
