"""The prefill engine: token ids in, per-layer post-RoPE K/V out, weights streamed through a
fixed device budget (DESIGN.md data path).

Covers positions `start..start+count-1`; the caller supplies the K/V of `0..start-1` when
`start > 0`. Only the embedding rows of the prompt's tokens are read; the LM head is never
needed. Runs on the calling thread (the node's device thread); the loader runs beside it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from nodes.events import EventBus, LayerEvent, LinkEvent
from nodes.model.errors import ModelError
from nodes.model.index import ModelIndex, load_index
from nodes.prefill.blocks import (
    LayerState,
    activation_bytes,
    attention_part,
    inv_freq,
    mlp_part,
    rope_tables,
)
from nodes.prefill.dequant import DequantizedWeights, dequantize
from nodes.prefill.movers import FillTimes, HostTier, Mover, make_mover
from nodes.prefill.plan import Load, Part, Plan, make_plan
from nodes.prefill.streamer import TORCH_DTYPES, LayerStreamer, LoaderHooks, part_weights

log = logging.getLogger(__name__)
DEFAULT_CHUNK_TOKENS = 512


class PrefillError(ValueError):
    """A request the engine refuses (bad tokens, bad prefix): the caller's fault."""


@dataclass(frozen=True)
class LayerKV:
    """One finished layer: K and V [1, n_kv, count, D] on the host, in the model dtype."""

    layer: int
    k: torch.Tensor
    v: torch.Tensor


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
    disk_bytes: int = 0
    resident_layers: list[int] = field(default_factory=list)
    layer_compute_s: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        keys = (
            "tokens", "layers", "wall_s", "load_busy_s", "compute_busy_s", "budget_bytes",
            "peak_weight_bytes", "peak_activation_bytes", "bytes_streamed", "disk_bytes",
            "resident_layers",
        )  # fmt: skip
        return {k: getattr(self, k) for k in keys}


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_budget(index: ModelIndex, device: torch.device) -> int:
    """80% of free device memory (the whole model when that is smaller)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(int(free * 0.8), index.total_bytes)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(int(pages * 0.8), index.total_bytes)


class PrefillEngine:
    """Layer-streamed prefill of one model on one device."""

    def __init__(
        self,
        model: str | os.PathLike[str] | ModelIndex,
        *,
        budget: int | None = None,
        device: str | torch.device | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        link_gbps: float | None = None,
        events: EventBus | None = None,
        host_budget: int | None = None,
        mover: Callable[[list[str], torch.device, float | None], Mover] = make_mover,
    ) -> None:
        self.index = model if isinstance(model, ModelIndex) else load_index(model)
        self.spec = self.index.spec
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = TORCH_DTYPES[self.index.dtype]  # compute dtype
        self.budget = budget if budget is not None else default_budget(self.index, self.device)
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.chunk_tokens = chunk_tokens
        self.events = events or EventBus()
        # on a CPU the slots are host memory: lay loads out for O_DIRECT reads straight in
        self.plan: Plan = make_plan(self.index, self.budget, direct=self.device.type == "cpu")
        files = [str(f) for f in self.index.files]
        moving = mover(files, self.device, link_gbps)
        if host_budget:
            streamed = [ld for ld in self.plan.loads if not ld.resident]
            moving.tier = HostTier(streamed, host_budget, pin=self.device.type == "cuda")
        self.streamer = LayerStreamer(self.plan, moving)
        # a part's quantized matrices are dequantized here, one part at a time
        self._scratch = torch.empty(self.plan.scratch_bytes, dtype=torch.uint8, device=self.device)
        self._embed_fd = os.open(self.index.globals["model.embed_tokens.weight"].file, os.O_RDONLY)
        self._freqs = inv_freq(self.spec)
        self.last_stats = PrefillStats()
        log.info(
            "plan: %s granularity, %d ring slots of %d B, resident layers %s, pool %d B "
            "+ scratch %d B of %d",
            self.plan.granularity,
            self.plan.n_slots,
            self.plan.slot_bytes,
            list(self.plan.resident_layers),
            self.plan.pool_bytes,
            self.plan.scratch_bytes,
            self.budget,
        )

    def close(self) -> None:
        self.streamer.close()
        os.close(self._embed_fd)

    def check_tokens(self, tokens: Sequence[int]) -> None:
        if len(tokens) == 0:
            raise PrefillError("empty token list")
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
        if bad:
            raise PrefillError(
                f"token id {bad[0]!r} outside the vocabulary [0, {self.spec.vocab_size})"
            )

    def _gather_rows(self, name: str, tokens: Sequence[int]) -> torch.Tensor:
        """Rows `tokens` of a global 2-D tensor, read from disk: [T, cols] on the host."""
        e = self.index.globals[name]
        fd = self._embed_fd
        if e.file != self.index.globals["model.embed_tokens.weight"].file:
            fd = os.open(e.file, os.O_RDONLY)
        row = e.nbytes // e.shape[0]
        rows = torch.empty((len(tokens), e.shape[1]), dtype=TORCH_DTYPES[e.dtype])
        buf = memoryview(rows.view(torch.uint8).numpy()).cast("B")
        try:
            for t in set(tokens):  # queue every row's read at once (cold: random 1-row reads)
                os.posix_fadvise(fd, e.offset + t * row, row, os.POSIX_FADV_WILLNEED)
            for i, t in enumerate(tokens):
                n = os.preadv(fd, [buf[i * row : (i + 1) * row]], e.offset + t * row)
                if n != row:
                    raise ModelError(f"{e.file}: short read in {name}")
        finally:
            if fd != self._embed_fd:
                os.close(fd)
        return rows

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Gather only the embedding rows of `tokens` from disk: [T, H] on the device; a
        quantized table's rows are dequantized after the gather (packed words, scales and
        biases of those rows only)."""
        weight = self._gather_rows("model.embed_tokens.weight", tokens)
        quant = self.spec.quantization.of("model.embed_tokens")
        if quant is None:
            return weight.to(self.device, self.dtype)
        scales = self._gather_rows("model.embed_tokens.scales", tokens).to(self.device)
        biases = self._gather_rows("model.embed_tokens.biases", tokens).to(self.device)
        # mlx-lm's embedding dequantizes in the scales' dtype, whatever the model computes in
        rows = dequantize(weight.to(self.device), scales, biases, quant, scales.dtype)
        return rows.to(self.dtype)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        start: int = 0,
        prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        request_id: str | None = None,
        compute: bool = True,
        synchronous: bool = False,
    ) -> Iterator[LayerKV]:
        """Yield each layer's K/V for `tokens` at positions start.. as soon as it is done.

        `prefix[i]` holds layer i's K/V for positions 0..start-1. `compute=False` streams the
        weights only (bench `load_s`); `synchronous=True` loads each load only when compute
        asks for it (bench `compute_s`).
        """
        self.check_tokens(tokens)
        if start and (prefix is None or len(prefix) != self.spec.num_layers):
            raise PrefillError("start > 0 needs the prefix K/V of every layer")
        rid = request_id or uuid.uuid4().hex[:12]
        spec, dev, T = self.spec, self.device, len(tokens)
        stats = PrefillStats(
            tokens=T,
            start=start,
            layers=spec.num_layers,
            budget_bytes=self.budget,
            peak_weight_bytes=self.plan.device_bytes,
            resident_layers=list(self.plan.resident_layers),
        )
        itemsize = torch.finfo(self.dtype).bits // 8
        stats.peak_activation_bytes = activation_bytes(spec, T, start, self.chunk_tokens, itemsize)
        self.last_stats = stats
        publish = self.events.publish
        for i in range(spec.num_layers):
            publish(LayerEvent(rid, layer=i, state="queued", pinned=i in self.plan.resident_layers))
        t_start = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        layer_state: LayerState | None = None
        hooks = LoaderHooks(on_loading=self._on_loading(rid), on_ready=self._on_ready(rid))
        with torch.inference_mode(), self.streamer.stream(hooks, synchronous) as loads:
            # the loader is already filling the ring while the prompt's rows are read
            h = self.embed(tokens) if compute else None
            rope = rope_tables(self._freqs, start, T, dev)
            for load, views in loads:
                if load.first_of_layer:
                    publish(self._layer_event(rid, load, "computing"))
                    layer_s = 0.0  # compute time of this layer, waits for its loads excluded
                    if compute:
                        layer_state = self._new_layer_state(load.layer, start, T, prefix)
                t_load = time.perf_counter()
                if compute:
                    assert h is not None and layer_state is not None
                    self._compute(load, views, h, layer_state, start, rope)
                    if dev.type == "cuda":
                        torch.cuda.current_stream(dev).synchronize()
                layer_s += time.perf_counter() - t_load
                if load.last_of_layer:
                    stats.layer_compute_s.append(layer_s)
                if not load.resident:
                    publish(self._layer_event(rid, load, "evicted"))
                if load.last_of_layer and compute:
                    assert layer_state is not None
                    yield LayerKV(
                        load.layer,
                        layer_state.k[:, :, start:].to("cpu").contiguous(),
                        layer_state.v[:, :, start:].to("cpu").contiguous(),
                    )
        stream = self.streamer.last_stats
        stats.wall_s = time.perf_counter() - t_start
        stats.load_busy_s = stream.load_busy_s
        stats.bytes_streamed = stream.bytes_streamed
        stats.disk_bytes = stream.disk_bytes
        stats.compute_busy_s = sum(stats.layer_compute_s)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) - self.plan.device_bytes
            stats.peak_activation_bytes = max(0, peak)

    def _new_layer_state(
        self,
        layer: int,
        start: int,
        count: int,
        prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> LayerState:
        spec = self.spec
        shape = (1, spec.num_kv_heads, start + count, spec.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        if start:
            assert prefix is not None
            pk, pv = prefix[layer]
            if tuple(pk.shape) != (1, spec.num_kv_heads, start, spec.head_dim):
                raise PrefillError(f"prefix K of layer {layer} has shape {tuple(pk.shape)}")
            k[:, :, :start] = pk.to(self.device, self.dtype)
            v[:, :, :start] = pv.to(self.device, self.dtype)
        return LayerState(k, v)

    def _compute(
        self,
        load: Load,
        views: dict[str, torch.Tensor],
        h: torch.Tensor,
        state: LayerState,
        start: int,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        for part in load.parts:
            w = self._dequantized(part, part_weights(views, part.op, part.lo))
            if part.op == "attn":
                attention_part(
                    self.spec, h, state, w, part.lo, part.hi, part.first, start, rope,
                    self.chunk_tokens,
                )  # fmt: skip
            else:
                mlp_part(self.spec, h, state, w, part.first, self.chunk_tokens)

    def _dequantized(self, part: Part, w: dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The part's weights, each quantized matrix dequantized into the scratch on use."""
        if not self.index.quantized:
            return w
        return DequantizedWeights(w, lambda module: self.index.quant(part.layer, module),
                                  self._scratch, self.dtype)  # fmt: skip

    def _layer_event(self, rid: str, load: Load, state: str, nbytes: int = 0) -> LayerEvent:
        return LayerEvent(
            rid,
            layer=load.layer,
            state=state,  # type: ignore[arg-type]
            slot=self.streamer.slot_of(load),
            pinned=load.resident,
            bytes=nbytes or load.nbytes,
        )

    def _on_loading(self, rid: str) -> Callable[[Load, int | None], None]:
        def hook(load: Load, slot: int | None) -> None:
            self.events.publish(self._layer_event(rid, load, "loading"))

        return hook

    def _on_ready(self, rid: str) -> Callable[[Load, int | None, FillTimes], None]:
        def hook(load: Load, slot: int | None, t: FillTimes) -> None:
            publish = self.events.publish
            if t.disk_bytes:
                publish(LinkEvent(rid, name="disk", bytes=t.disk_bytes, seconds=t.disk_s))
            publish(LinkEvent(rid, name="h2d", bytes=t.nbytes, seconds=t.h2d_s))
            publish(self._layer_event(rid, load, "ready", t.nbytes))

        return hook
