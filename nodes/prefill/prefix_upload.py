"""A request's prefix K/V to the device, once, without draining the compute stream.

After a cached prefix, each layer's state starts with that layer's K/V of positions
0..start-1, held in host memory (the node's prefix cache). On CUDA each layer's are pinned
once and copied on a side stream `AHEAD` layers before the layer computes; the compute
stream waits on the copy's event, not on the host. On a CPU the host tensors are the state's
source as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KV = tuple[torch.Tensor, torch.Tensor]  # K, V [1, n_kv, start, D]
AHEAD = 2  # layers whose prefix is on its way while one computes (in the activation reserve)


class PrefixUpload:
    """`layer(i)`: layer i's prefix K/V where its compute reads them (in layer order)."""

    def __init__(self, prefix: Sequence[KV], device: torch.device, dtype: torch.dtype) -> None:
        self.prefix, self.device, self.dtype = prefix, device, dtype
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._issued: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}
        self._next = 0  # the next layer to issue

    def layer(self, i: int) -> KV:
        if not self.cuda:
            return self.prefix[i]
        while self._next < min(i + 1 + AHEAD, len(self.prefix)):
            self._issue(self._next)
            self._next += 1
        k, v, copied = self._issued.pop(i)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(copied)
        k.record_stream(current)  # allocated on the side stream, used on this one
        v.record_stream(current)
        return k, v

    def _issue(self, i: int) -> None:
        """Layer i's prefix pinned (once) and copied on the side stream."""
        assert self.stream is not None
        k, v = (t.to(self.dtype).pin_memory() for t in self.prefix[i])
        with torch.cuda.stream(self.stream):
            dk = k.to(self.device, non_blocking=True)
            dv = v.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self._issued[i] = (dk, dv, copied)
