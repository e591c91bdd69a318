"""A request's prefix K/V to the device, once, without draining the compute stream.

After a cached prefix, each layer's state starts with that layer's K/V of positions
0..start-1, held in host memory (the node's prefix cache); a linear layer's, its state at
position start (`State`: named tensors, each in its own dtype). On CUDA each layer's are
copied on a side stream `AHEAD` layers before the layer computes, from where they lie: the
prefix cache keeps its entries in pinned memory there (`serving/prefix_arena.py`), and only a
layer that found no room in it is pinned here first, a copy (issue 48: every request pinned
its whole prefix again). K/V are converted to the compute dtype on the device. The compute
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
        """Layer i's prefix copied on the side stream: K/V then in the compute dtype, a
        state's tensors each in its own."""
        assert self.stream is not None
        entry = self.prefix[i]
        named = entry.items() if isinstance(entry, dict) else zip("kv", entry, strict=True)
        with torch.cuda.stream(self.stream):
            tensors = {name: _to_device(t, self.device) for name, t in named}
            if not isinstance(entry, dict):
                tensors = {name: t.to(self.dtype) for name, t in tensors.items()}
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self._issued[i] = (tensors, copied)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` copied to `device` on the current stream, the host not waiting: from
    pinned memory as it lies, else pinned first (a copy). A cut of a longer entry's K/V
    ([1, n_kv, j, D] of [1, n_kv, T, D]) is one run of positions per head, one copy each: a
    strided source would be gathered into pageable memory and copied synchronously."""
    if not t.is_pinned():
        t = t.pin_memory()
    if t.is_contiguous() or t.dim() != 4:
        return t.to(device, non_blocking=True)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    for h in range(t.shape[1]):
        out[:, h].copy_(t[:, h], non_blocking=True)
    return out
