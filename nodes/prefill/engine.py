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
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tandem.nodes.contract.events import EventBus, LayerEvent, LinkEvent
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.blocks import (
    LayerState,
    activation_bytes,
    attention_part,
    mlp_part,
    out_rows_part,
)
from tandem.nodes.prefill.dequant import DequantizedWeights, dequantize
from tandem.nodes.prefill.kv_quant import Scratch, quantize_all
from tandem.nodes.prefill.loads import Load, Part
from tandem.nodes.prefill.plan import Plan, make_plan
from tandem.nodes.prefill.rope import inv_freq, rope_tables
from tandem.nodes.prefill.stream.movers import FillTimes, HostArena, HostTier, Mover, make_mover
from tandem.nodes.prefill.stream.streamer import (
    TORCH_DTYPES,
    LayerStreamer,
    LoaderHooks,
    part_weights,
)

log = logging.getLogger(__name__)
DEFAULT_CHUNK_TOKENS = 512
DEFAULT_MAX_PROMPT_TOKENS = 8192  # CUDA: the longest prompt whose activations are reserved


class PrefillError(ValueError):
    """A request the engine refuses (bad tokens, bad prefix): the caller's fault."""


class PromptTooLong(PrefillError):
    """A prompt whose activations do not fit the room reserved for them (HTTP 413)."""


@dataclass(frozen=True)
class LayerKV:
    """One finished layer: K and V [1, n_kv, count, D] on the host, in the model dtype, and
    when a KV format was asked for, the same quantized on the device (`quantized`: `k`, `v`
    packed words and `k_scales`, `k_biases`, `v_scales`, `v_biases`, as `Header.tensors`)."""

    layer: int
    k: torch.Tensor
    v: torch.Tensor
    quantized: dict[str, torch.Tensor] | None = None


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
    disk_s: float = 0.0  # loader time reading from disk
    h2d_s: float = 0.0  # host→device copy time (CUDA: from events on the copy stream)
    pinned_bytes: int = 0
    activation_reserve_bytes: int = 0
    quantize_s: float = 0.0  # quantizing K/V for the wire (CPU: wall; CUDA: its kernels)
    resident_layers: list[int] = field(default_factory=list)
    layer_compute_s: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        keys = (
            "tokens", "layers", "wall_s", "load_busy_s", "compute_busy_s", "budget_bytes",
            "peak_weight_bytes", "peak_activation_bytes", "bytes_streamed", "disk_bytes",
            "disk_s", "h2d_s", "pinned_bytes", "activation_reserve_bytes", "quantize_s",
            "resident_layers",
        )  # fmt: skip
        return {k: getattr(self, k) for k in keys}


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def longest_prompt(spec: ModelSpec, device: str, asked: int | None = None) -> int | None:
    """The longest prompt a node takes, whose activations its budget reserves: `asked`, else
    on CUDA the model's context up to `DEFAULT_MAX_PROMPT_TOKENS`, else (host memory is the
    budget there) any: None, nothing reserved."""
    if asked is None and device == "cuda":
        return min(spec.max_position_embeddings, DEFAULT_MAX_PROMPT_TOKENS)
    return asked or None


def prompt_activations(
    spec: ModelSpec, count: int, start: int, chunk: int, itemsize: int, device: str,
    cut_ops: bool,
) -> int:  # fmt: skip
    """Device bytes of activations for `count` new tokens after `start` (0 for none), as
    blocks.py computes them on `device` (`blocks.fused_attention`: all queries at once)."""
    if count <= 0:
        return 0
    return activation_bytes(
        spec, count, start, chunk, itemsize, device_type=device, cut_ops=cut_ops
    )


def plan_for_prompts(
    index: ModelIndex, budget: int, tokens: int | None, device: str,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Plan:  # fmt: skip
    """The plan a node makes for `budget` bytes with room kept for the activations of a
    `tokens` prompt (none for None), its loads laid out for O_DIRECT reads (straight into the
    slot on a CPU, into pinned staging on CUDA). Planned first with what whole ops need; when
    the weights left must be cut into row ranges, again with room for the cut op's kept
    output too ([tokens, intermediate]: 470 MiB at 8k tokens for a 70B model)."""

    def plan(cut_ops: bool) -> Plan:
        itemsize = ITEMSIZE[index.dtype]
        reserve = prompt_activations(index.spec, tokens or 0, 0, chunk, itemsize, device, cut_ops)
        return make_plan(index, budget, direct=True, reserve=reserve)

    whole = plan(cut_ops=False)
    return plan(cut_ops=True) if whole.cuts_ops and whole.reserve_bytes else whole


def default_budget(index: ModelIndex, device: torch.device, reserve: int = 0) -> int:
    """80% of free device memory, or what the whole model takes resident (its weights, a
    quantized model's scratch, and `reserve` bytes of activations) when that is smaller."""
    whole = make_plan(index, 1 << 62, direct=True).device_bytes + reserve
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(int(free * 0.8), whole)


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
        max_prompt_tokens: int | None = None,
        mover: Callable[[list[str], torch.device, float | None], Mover] = make_mover,
    ) -> None:
        self.index = model if isinstance(model, ModelIndex) else load_index(model)
        self.spec = self.index.spec
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = TORCH_DTYPES[self.index.dtype]  # compute dtype
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.chunk_tokens = chunk_tokens
        self.events = events or EventBus()
        # the budget holds the activations of the longest prompt taken, then the weights
        self.max_prompt_tokens = longest_prompt(self.spec, self.device.type, max_prompt_tokens)
        whole_ops = self._activations(self.max_prompt_tokens or 0, 0, cut_ops=False)
        self.budget = (
            budget if budget is not None else default_budget(self.index, self.device, whole_ops)
        )
        self.plan: Plan = plan_for_prompts(
            self.index, self.budget, self.max_prompt_tokens, self.device.type, chunk_tokens
        )
        self.activation_reserve = self.plan.reserve_bytes
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
        self._handover = (
            _CudaHandover(self.device) if self.device.type == "cuda" else _HostHandover()
        )
        self.last_stats = PrefillStats()
        log.info(
            "plan: %s granularity, %d ring slots of %d B, resident layers %s, pool %d B "
            "+ scratch %d B + activations %d B (prompts up to %s tokens) of %d; %d B pinned",
            self.plan.granularity,
            self.plan.n_slots,
            self.plan.slot_bytes,
            list(self.plan.resident_layers),
            self.plan.pool_bytes,
            self.plan.scratch_bytes,
            self.activation_reserve,
            self.max_prompt_tokens or "any",
            self.budget,
            moving.pinned_bytes,
        )

    def _activations(self, count: int, start: int, cut_ops: bool | None = None) -> int:
        """Device bytes of activations for `count` new tokens after `start` (0 for none), with
        room for a cut op's kept output where the plan cuts one (or as `cut_ops` says)."""
        cut = self.plan.cuts_ops if cut_ops is None else cut_ops
        itemsize = ITEMSIZE[self.index.dtype]
        return prompt_activations(
            self.spec, count, start, self.chunk_tokens, itemsize, self.device.type, cut
        )

    def check_fits(self, count: int, start: int = 0) -> None:
        """Refuse, before any streaming, a prompt whose activations exceed the reserve."""
        if self.max_prompt_tokens is None:
            return
        need = self._activations(count, start)
        if need > self.activation_reserve:
            raise PromptTooLong(
                f"a prompt of {start + count} tokens needs {need / 2**20:.0f} MiB of activations;"
                f" this node reserves {self.activation_reserve / 2**20:.0f} MiB (prompts up to "
                f"{self.max_prompt_tokens} tokens): raise --max-prompt-tokens and --budget"
            )

    def close(self) -> None:
        self.streamer.close()
        self._handover.close()
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
        kv_format: KVFormat | None = None,
    ) -> Iterator[LayerKV]:
        """Yield each layer's K/V for `tokens` at positions start.. as soon as it is done.

        `prefix[i]` holds layer i's K/V for positions 0..start-1. `compute=False` streams the
        weights only (bench `load_s`); `synchronous=True` loads each load only when compute
        asks for it (bench `compute_s`).
        """
        self.check_tokens(tokens)
        if start and (prefix is None or len(prefix) != self.spec.num_layers):
            raise PrefillError("start > 0 needs the prefix K/V of every layer")
        self.check_fits(len(tokens), start)
        rid = request_id or uuid.uuid4().hex[:12]
        spec, dev, T = self.spec, self.device, len(tokens)
        stats = PrefillStats(
            tokens=T,
            start=start,
            layers=spec.num_layers,
            budget_bytes=self.budget,
            peak_weight_bytes=self.plan.device_bytes,
            peak_activation_bytes=self._activations(T, start),
            pinned_bytes=self.streamer.mover.pinned_bytes,
            activation_reserve_bytes=self.activation_reserve,
            resident_layers=list(self.plan.resident_layers),
        )
        self.last_stats = stats
        publish = self.events.publish
        for i in range(spec.num_layers):
            publish(LayerEvent(rid, layer=i, state="queued", pinned=i in self.plan.resident_layers))
        t_start = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # this thread's current device: streams, events, kernels
            torch.cuda.reset_peak_memory_stats(dev)
        layer_state: LayerState | None = None
        clock = _ComputeClock(dev)
        self._handover.reset(kv_format)
        hooks = LoaderHooks(on_loading=self._on_loading(rid), on_ready=self._on_ready(rid))
        with torch.inference_mode(), self.streamer.stream(hooks, synchronous) as run:
            # the loader is already filling the ring while the prompt's rows are read
            h = self.embed(tokens) if compute else None
            rope = rope_tables(self._freqs, start, T, dev)
            for load, views in run:
                if load.first_of_layer:
                    publish(self._layer_event(rid, load, "computing"))
                    if compute:
                        layer_state = self._new_layer_state(load.layer, start, T, prefix)
                if compute:
                    assert h is not None and layer_state is not None
                    with clock.timing(load.layer):
                        self._compute(load, views, h, layer_state, start, rope)
                run.release(load)  # its kernels are queued: the loader may refill the slot
                if not load.resident:
                    publish(self._layer_event(rid, load, "evicted"))
                if load.last_of_layer and compute:
                    yield from self._handover.push()
            yield from self._handover.flush()
        stream = self.streamer.last_stats
        stats.wall_s = time.perf_counter() - t_start
        stats.load_busy_s = stream.load_busy_s
        stats.bytes_streamed = stream.bytes_streamed
        stats.disk_bytes = stream.disk_bytes
        stats.disk_s = stream.disk_s
        stats.h2d_s = stream.h2d_s
        stats.layer_compute_s = clock.per_layer(spec.num_layers) if compute else []
        stats.compute_busy_s = sum(stats.layer_compute_s)
        stats.quantize_s = self._handover.quantize_seconds()
        if dev.type == "cuda":
            if stream.h2d_s:  # per-load copy times exist only once the request is done
                publish(
                    LinkEvent(rid, name="h2d", bytes=stream.bytes_streamed, seconds=stream.h2d_s)
                )
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
        spec, chunk = self.spec, self.chunk_tokens
        for part in load.parts:
            raw = part_weights(views, part.op, part.lo)
            if part.op in ("o", "down"):
                self._out_rows(part, raw, h, state)
                continue
            w = self._dequantized(part, raw)
            if part.op in ("attn", "qkv"):
                attention_part(
                    spec, h, state, w, part.lo, part.hi, part.first, start, rope, chunk,
                    with_o=part.op == "attn",
                )  # fmt: skip
                if part.last:  # the layer's K/V are final: the MLP does not touch them
                    self._handover.kv_done(part.layer, state, start)
            else:
                mlp_part(spec, h, state, w, part.first, chunk, part.lo, part.hi,
                         with_down=part.op == "mlp")  # fmt: skip

    def _out_rows(
        self, part: Part, w: dict[str, torch.Tensor], h: torch.Tensor, state: LayerState
    ) -> None:
        """An "o" or "down" part. A quantized matrix is dequantized a block of rows at a time,
        as many as the scratch holds (the plan sizes it for the other parts' matrices): each
        block adds its own residual columns."""
        module = "self_attn.o_proj" if part.op == "o" else "mlp.down_proj"
        weight, chunk = w[f"{module}.weight"], self.chunk_tokens
        quant = self.index.quant(part.layer, module)
        if quant is None:
            out_rows_part(h, state, weight, part.lo, part.hi, part.last, chunk)
            return
        scales, biases = w[f"{module}.scales"], w[f"{module}.biases"]
        rows, cols = scales.shape[0], scales.shape[1] * quant.group_size
        row_bytes = cols * torch.finfo(self.dtype).bits // 8
        block = max(1, self._scratch.numel() // row_bytes)
        for a in range(0, rows, block):
            b = min(rows, a + block)
            dest = self._scratch[: (b - a) * row_bytes].view(self.dtype).view(b - a, cols)
            wq = dequantize(weight[a:b], scales[a:b], biases[a:b], quant, self.dtype, out=dest)
            last = part.last and b == rows
            out_rows_part(h, state, wq, part.lo + a, part.lo + b, last, chunk)

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


class _ComputeClock:
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


class _HostHandover:
    """Finished layers' K/V: on a CPU they are host memory already (another device's are
    copied at once). A layer's are taken, and quantized, once its attention is done (the MLP
    does not touch them), and handed over after the layer."""

    def __init__(self) -> None:
        self.kv_format: KVFormat | None = None
        self._quantize_s = 0.0
        self._scratch = Scratch()
        self._done: list[LayerKV] = []

    def kv_done(self, layer: int, state: LayerState, start: int) -> None:
        k, v = state.k[:, :, start:], state.v[:, :, start:]
        quantized = None
        if self.kv_format is not None:
            t0 = time.perf_counter()
            parts = quantized_parts(k, v, self.kv_format, self._scratch)
            quantized = {name: t.to("cpu") for name, t in parts.items()}
            self._quantize_s += time.perf_counter() - t0
        self._done.append(
            LayerKV(layer, k.to("cpu").contiguous(), v.to("cpu").contiguous(), quantized)
        )

    def push(self) -> list[LayerKV]:
        """The layers whose K/V are done, once the layer is (the consumer's turn)."""
        done, self._done = self._done, []
        return done

    def flush(self) -> list[LayerKV]:
        return self.push()

    def reset(self, kv_format: KVFormat | None = None) -> None:
        self.kv_format = kv_format
        self._quantize_s = 0.0
        self._done.clear()

    def quantize_seconds(self) -> float:
        return self._quantize_s

    def close(self) -> None:
        pass


class _CudaHandover:
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
        self._pending: deque[tuple[int, dict[str, torch.Tensor], torch.cuda.Event]] = deque()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._scratch = Scratch()  # used on the compute stream only

    def _pinned(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pinned host tensors shaped like `like`, from a ring of LAG + 1 buffers."""
        sizes = {name: -(-t.numel() * t.element_size() // 64) * 64 for name, t in like.items()}
        nbytes = sum(sizes.values())
        if self._arena is None or not self._buffers or self._buffers[0].numel() < nbytes:
            if self._arena is not None:  # a longer prompt than any before: re-pin, once
                self.stream.synchronize()  # no copy into the old buffers still in flight
                self._arena.close()
            self._arena = HostArena([nbytes] * (self.LAG + 1), pin=True)
            self._buffers = deque(self._arena.take(nbytes) for _ in range(self.LAG + 1))
        buf = self._buffers[0]
        self._buffers.rotate(-1)
        out, at = {}, 0
        for name, t in like.items():
            raw = buf[at : at + t.numel() * t.element_size()]
            out[name] = raw.view(t.dtype).view(t.shape)
            at += sizes[name]
        return out

    def kv_done(self, layer: int, state: LayerState, start: int) -> None:
        k, v = state.k[:, :, start:], state.v[:, :, start:]
        device = {"k": k, "v": v}
        if self.kv_format is not None:  # on the compute stream, after the attention
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(torch.cuda.current_stream(self.device))
            parts = quantized_parts(k, v, self.kv_format, self._scratch)
            device |= {f"q_{n}": t for n, t in parts.items()}
            b.record(torch.cuda.current_stream(self.device))
            self._timed.append((a, b))
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
        for t in (state.k, state.v, *device.values()):  # not reused before the copy ran
            t.record_stream(self.stream)
        self._pending.append((layer, host, copied))

    def push(self) -> list[LayerKV]:
        """After a layer: the layers whose copies are done, but the last LAG."""
        return self._ready(self.LAG)

    def flush(self) -> list[LayerKV]:
        return self._ready(0)

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

    def _ready(self, keep: int) -> list[LayerKV]:
        out = []
        while len(self._pending) > keep:
            layer, host, copied = self._pending.popleft()
            copied.synchronize()
            quantized = {n[2:]: t.clone() for n, t in host.items() if n.startswith("q_")}
            out.append(LayerKV(layer, host["k"].clone(), host["v"].clone(), quantized or None))
        return out
