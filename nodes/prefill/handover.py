"""A finished layer's handover: what it hands the decode node, taken off the device without
stalling compute.

`HostHandover` on a CPU (the K/V are host memory already); `CudaHandover` copies each layer's
on a side stream into pinned buffers while the GPU computes its MLP, and hands it over one
layer later. Either quantizes the K/V first when the request asked for a KV format.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.model.kv_bytes import kv_bytes
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.kernels.kv_quant import Scratch, quantize_all
from tandem.nodes.prefill.stream.movers import HostArena


@dataclass(frozen=True)
class LayerKV:
    """One finished layer: K and V [1, n_kv, count, D] on the host, in the model dtype, and
    when a KV format was asked for, the same quantized on the device (`quantized`: `k`, `v`
    packed words and `k_scales`, `k_biases`, `v_scales`, `v_biases`, as `Header.tensors`)."""

    layer: int
    k: torch.Tensor
    v: torch.Tensor
    quantized: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class LinearState:
    """One finished linear layer: its state after the prompt on the host, by name (the KV
    header's `state`: Qwen3.5's "conv" [1, K-1, conv_dim] in the model dtype, "recurrent"
    [1, Hv, Dv, Dk] float32); never quantized."""

    layer: int
    tensors: dict[str, torch.Tensor]


Handed = LayerKV | LinearState  # what a layer hands the decode node


def quantized_parts(
    k: torch.Tensor, v: torch.Tensor, kv_format: KVFormat, scratch: Scratch | None = None
) -> dict[str, torch.Tensor]:
    """K and V [1, n_kv, count, D] quantized where they are (`Header.tensors` names), widened
    in `scratch` (kept from layer to layer by a caller that quantizes many)."""
    out: dict[str, torch.Tensor] = {}
    fmt = kv_format
    both = quantize_all((k, v), fmt.group_size, fmt.bits, kernel=fmt.kernel, scratch=scratch)
    for name, (words, scales, biases) in zip(("k", "v"), both, strict=True):
        out[name], out[f"{name}_scales"], out[f"{name}_biases"] = words, scales, biases
    return out


def _int32(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """uint32 tensors as int32 views (torch's uint32 is a storage type with few kernels)."""
    return tuple(t.view(torch.int32) for t in ts)


class HostHandover:
    """Finished layers' K/V: on a CPU they are host memory already (another device's are
    copied at once). A layer's are taken, and quantized, once its attention is done (the MLP
    does not touch them), and handed over after the layer."""

    def __init__(self) -> None:
        self.kv_format: KVFormat | None = None
        self._quantize_s = 0.0
        self._scratch = Scratch()
        self._done: list[Handed] = []

    def kv_done(self, layer: int, k: torch.Tensor, v: torch.Tensor, quantize: bool = True) -> None:
        """Layer `layer`'s handover, K and V [1, n_kv, count, D] (views into its state),
        quantized where a KV format was asked for and `quantize` (a full layer)."""
        quantized = None
        if self.kv_format is not None and quantize:
            t0 = time.perf_counter()
            parts = quantized_parts(k, v, self.kv_format, self._scratch)
            quantized = {name: t.to("cpu") for name, t in parts.items()}
            self._quantize_s += time.perf_counter() - t0
        self._done.append(
            LayerKV(layer, k.to("cpu").contiguous(), v.to("cpu").contiguous(), quantized)
        )

    def state_done(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """A linear layer's handover: its state tensors, copied (the layer's own are its
        working state)."""
        self._done.append(
            LinearState(layer, {n: t.to("cpu", copy=True) for n, t in tensors.items()})
        )

    def reserve(self, nbytes: int) -> None:
        """Nothing to pin: the K/V are host memory already."""

    def take(self, last: bool = False) -> list[Handed]:
        """The layers whose K/V are done, once the layer is (the consumer's turn)."""
        done, self._done = self._done, []
        return done

    def reset(self, kv_format: KVFormat | None = None) -> None:
        self.kv_format = kv_format
        self._quantize_s = 0.0
        self._done.clear()

    def quantize_seconds(self) -> float:
        return self._quantize_s

    def close(self) -> None:
        pass


class CudaHandover:
    """Finished layers' K/V to host memory without stalling compute: a side stream copies each
    layer's (and its quantized form), once its attention's kernels are done, into reused
    pinned buffers, while the GPU computes its MLP; a layer is handed over one layer later
    (after its copy's event), as pageable clones the consumer may keep, while the GPU already
    computes the next one."""

    LAG = 1  # layers in flight between the GPU and the consumer

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.kv_format: KVFormat | None = None
        self._arena: HostArena | None = None
        self._buffers: deque[torch.Tensor] = deque()
        # (layer, host tensors, their copy's event, a linear layer's state)
        self._pending: deque[tuple[int, dict[str, torch.Tensor], torch.cuda.Event, bool]] = deque()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._scratch = Scratch()  # used on the compute stream only

    def reserve(self, nbytes: int) -> None:
        """Buffers for a layer's handover of up to `nbytes`, pinned before the pass (grown a
        quarter beyond, so slowly longer prompts seldom re-pin): a layer larger than the
        buffers re-pinned them mid-pass, a stream sync and a registration between two
        layers (issue 48)."""
        if self._arena is None or not self._buffers or self._buffers[0].numel() < nbytes:
            have = self._buffers[0].numel() if self._buffers else 0
            self._grow(max(nbytes, have + have // 4))

    def _grow(self, nbytes: int) -> None:
        if self._arena is not None:  # no copy into the old buffers may still be in flight
            self.stream.synchronize()
            self._arena.close()
        self._arena = HostArena([nbytes] * (self.LAG + 1), pin=True)
        self._buffers = deque(self._arena.take(nbytes) for _ in range(self.LAG + 1))

    def _pinned(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pinned host tensors shaped like `like`, from a ring of LAG + 1 buffers (`reserve`
        sized them for the pass; one larger still grows them here)."""
        sizes = {name: -(-t.numel() * t.element_size() // 64) * 64 for name, t in like.items()}
        nbytes = sum(sizes.values())
        if self._arena is None or not self._buffers or self._buffers[0].numel() < nbytes:
            self._grow(nbytes)
        buf = self._buffers[0]
        self._buffers.rotate(-1)
        out, at = {}, 0
        for name, t in like.items():
            raw = buf[at : at + t.numel() * t.element_size()]
            out[name] = raw.view(t.dtype).view(t.shape)
            at += sizes[name]
        return out

    def kv_done(self, layer: int, k: torch.Tensor, v: torch.Tensor, quantize: bool = True) -> None:
        """Layer `layer`'s handover, K and V [1, n_kv, count, D] (views into its state),
        quantized where a KV format was asked for and `quantize` (a full layer)."""
        device = {"k": k, "v": v}
        if self.kv_format is not None and quantize:  # on the compute stream, after the attention
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(torch.cuda.current_stream(self.device))
            parts = quantized_parts(k, v, self.kv_format, self._scratch)
            device |= {f"q_{n}": t for n, t in parts.items()}
            b.record(torch.cuda.current_stream(self.device))
            self._timed.append((a, b))
        self._copy(layer, device, state=False)

    def state_done(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """A linear layer's handover: its state tensors, copied to the host the same way."""
        self._copy(layer, dict(tensors), state=True)

    def _copy(self, layer: int, device: dict[str, torch.Tensor], state: bool) -> None:
        """`device` tensors into pinned buffers on the side stream, once the compute stream
        made them; handed over by `_ready`."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        host = self._pinned(device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(done)
            for name, t in device.items():  # packed words copied as int32: the same bits
                dst, src = (host[name], t) if t.dtype != torch.uint32 else _int32(host[name], t)
                dst.copy_(src, non_blocking=True)
            copied = torch.cuda.Event(blocking=True)
            copied.record(self.stream)
        for t in device.values():  # their memory is not reused before the copy ran
            t.record_stream(self.stream)
        self._pending.append((layer, host, copied, state))

    def take(self, last: bool = False) -> list[Handed]:
        """After a layer: the layers whose copies are done, but the last LAG; after the
        `last` layer, every one."""
        return self._ready(0 if last else self.LAG)

    def close(self) -> None:
        """Unpin the buffers, once no copy is in flight."""
        self.stream.synchronize()
        self._pending.clear()
        if self._arena is not None:
            self._arena.close()
            self._arena, self._buffers = None, deque()

    def reset(self, kv_format: KVFormat | None = None) -> None:
        """Forget what an abandoned request left in flight; take the next request's format."""
        self.stream.synchronize()
        self._pending.clear()
        self._timed.clear()
        self.kv_format = kv_format

    def quantize_seconds(self) -> float:
        if not self._timed:
            return 0.0
        self._timed[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self._timed) / 1000

    def _ready(self, keep: int) -> list[Handed]:
        out: list[Handed] = []
        while len(self._pending) > keep:
            layer, host, copied, state = self._pending.popleft()
            copied.synchronize()
            if state:
                out.append(LinearState(layer, {n: t.clone() for n, t in host.items()}))
                continue
            quantized = {n[2:]: t.clone() for n, t in host.items() if n.startswith("q_")}
            out.append(LayerKV(layer, host["k"].clone(), host["v"].clone(), quantized or None))
        return out


Handover = HostHandover | CudaHandover


def handover_bytes(spec: ModelSpec, itemsize: int, count: int) -> int:
    """The most a layer of a `count`-token request hands over: its K and V, their quantized
    form (less than they), or a linear layer's state; 64-byte aligned each."""
    kv = kv_bytes(spec, None, itemsize)  # per layer: K and V a position
    most = max(2 * max(kv.per_token, default=0) * count, max(kv.fixed, default=0))
    return most + 6 * 64


def make_handover(device: torch.device) -> Handover:
    return CudaHandover(device) if device.type == "cuda" else HostHandover()
