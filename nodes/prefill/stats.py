"""A prefill's numbers: `PrefillStats` (what `tandem prefill --stats-json`, the bench and the
node report), and the per-layer compute clock they come from."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PrefillStats:
    tokens: int = 0
    start: int = 0
    layers: int = 0
    wall_s: float = 0.0
    load_busy_s: float = 0.0
    compute_busy_s: float = 0.0
    budget_bytes: int = 0
    peak_weight_bytes: int = 0
    peak_activation_bytes: int = 0
    bytes_streamed: int = 0
    disk_bytes: int = 0  # of bytes_streamed, read from disk
    ram_bytes: int = 0  # of bytes_streamed, copied from the RAM tier (no disk read)
    disk_s: float = 0.0  # loader time reading from disk
    h2d_s: float = 0.0  # host→device copy time (CUDA: from events on the copy stream)
    pinned_bytes: int = 0
    activation_reserve_bytes: int = 0
    quantize_s: float = 0.0  # quantizing K/V for the wire (CPU: wall; CUDA: its kernels)
    resident_layers: list[int] = field(default_factory=list)
    layer_compute_s: list[float] = field(default_factory=list)
    experts_streamed: dict[int, int] = field(default_factory=dict)  # MoE layer → experts read
    bytes_by_kind: dict[str, int] = field(default_factory=dict)  # streamed: attention, mlp, ...
    route_wait_s: float = 0.0  # MoE: the loader's time waiting for routers (its link idle)

    def took(self, stream: Any) -> None:
        """What the streamer's pass (`StreamStats`) says of the bytes and the loader's time."""
        self.load_busy_s = stream.load_busy_s
        self.bytes_streamed = stream.bytes_streamed
        self.disk_bytes = stream.disk_bytes
        self.ram_bytes = stream.bytes_streamed - stream.disk_bytes  # the rest: the RAM tier
        self.disk_s = stream.disk_s
        self.h2d_s = stream.h2d_s
        self.experts_streamed = dict(stream.experts_streamed)
        self.bytes_by_kind = dict(stream.bytes_by_kind)
        self.route_wait_s = stream.route_wait_s

    def to_json(self) -> dict[str, object]:
        keys = (
            "tokens", "layers", "wall_s", "load_busy_s", "compute_busy_s", "budget_bytes",
            "peak_weight_bytes", "peak_activation_bytes", "bytes_streamed", "disk_bytes",
            "ram_bytes", "disk_s", "h2d_s", "pinned_bytes", "activation_reserve_bytes",
            "quantize_s", "resident_layers", "experts_streamed", "bytes_by_kind", "route_wait_s",
        )  # fmt: skip
        return {k: getattr(self, k) for k in keys}


class ComputeClock:
    """Compute seconds per layer, waits for loads excluded. CPU: wall time around each load's
    compute. CUDA: events around each load's kernels, read once the request is done — never
    a sync per load, which would leave the GPU idle while Python queues the next one."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._seconds: dict[int, float] = {}
        self._events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timing(self, layer: int) -> Iterator[None]:
        if self._cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(torch.cuda.current_stream(self._device))
            yield
            b.record(torch.cuda.current_stream(self._device))
            self._events.append((layer, a, b))
            return
        t0 = time.perf_counter()
        yield
        self._seconds[layer] = self._seconds.get(layer, 0.0) + time.perf_counter() - t0

    def per_layer(self, layers: int) -> list[float]:
        if self._events:
            self._events[-1][2].synchronize()
            for layer, a, b in self._events:
                self._seconds[layer] = self._seconds.get(layer, 0.0) + a.elapsed_time(b) / 1000
            self._events.clear()
        return [self._seconds.get(i, 0.0) for i in range(layers)]
