"""A request's prefix K/V to the device, once, without draining the compute stream.

After a cached prefix, each layer's state starts with that layer's K/V of positions
0..start-1, held in host memory (the node's prefix cache); a linear layer's, its state at
position start (`State`: named tensors, each in its own dtype). On CUDA each layer's are
pinned once and copied on a side stream `AHEAD` layers before the layer computes; the compute
stream waits on the copy's event, not on the host. On a CPU the host tensors are the state's
source as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KV = tuple[torch.Tensor, torch.Tensor]  # K, V [1, n_kv, start, D]
State = dict[str, torch.Tensor]  # a linear layer's state tensors by name
Prefix = KV | State  # one layer's
AHEAD = 2  # layers whose prefix is on its way while one computes (in the activation reserve)


class PrefixUpload:
    """`layer(i)`: layer i's prefix K/V where its compute reads them (in layer order)."""

    def __init__(self, prefix: Sequence[Prefix], device: torch.device, dtype: torch.dtype) -> None:
        self.prefix, self.device, self.dtype = prefix, device, dtype
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._issued: dict[int, tuple[State, torch.cuda.Event]] = {}
        self._next = 0  # the next layer to issue

    def layer(self, i: int) -> Prefix:
        if not self.cuda:
            return self.prefix[i]
        while self._next < min(i + 1 + AHEAD, len(self.prefix)):
            self._issue(self._next)
            self._next += 1
        tensors, copied = self._issued.pop(i)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(copied)
        for t in tensors.values():
            t.record_stream(current)  # allocated on the side stream, used on this one
        return tensors if isinstance(self.prefix[i], dict) else (tensors["k"], tensors["v"])

    def _issue(self, i: int) -> None:
        """Layer i's prefix pinned (once) and copied on the side stream: K/V in the compute
        dtype, a state's tensors each in its own."""
        assert self.stream is not None
        entry = self.prefix[i]
        if isinstance(entry, dict):
            host = {name: t.pin_memory() for name, t in entry.items()}
        else:
            host = {
                name: t.to(self.dtype).pin_memory() for name, t in zip("kv", entry, strict=True)
            }
        with torch.cuda.stream(self.stream):
            tensors = {name: t.to(self.device, non_blocking=True) for name, t in host.items()}
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self._issued[i] = (tensors, copied)
