"""The prefill node's cost model: how long one pass of a plan takes on given hardware.

`predict` replays the ring as a discrete-event simulation (`simulate`), mirroring
`streamer.py` and `movers.py`: one loader thread takes loads in plan order; a streamed load
goes to ring slot `k mod n_slots` (k counts streamed loads) and is read only once the slot's
previous occupant is released; compute takes loads in order, each once it is in memory and
the one before it is done. Resident loads are warm (loaded at warm-up): no read, no copy.

- CPU: the slot is host memory and the read lands in it; a slot is released when its compute
  ends. `copy_Bps` is the emulated link (`--link-gbps`), which caps the whole fill, or the
  memcpy rate when calibrated (then no cap).
- CUDA: the read lands in one of `N_STAGING` pinned buffers, taken in turn and refilled
  once their last copy is done; the copy crosses PCIe on one copy stream after the slot's
  previous occupant's compute; the loader reads on while it runs; a slot is released as soon
  as its compute is queued.

A load computes its matmuls at `flops`, its attention kernel at `attn_flops`, and the rest
(norms, RoPE, SwiGLU, residual adds: memory-bound) at `elementwise_Bps` of activations,
all times `overhead`: what one layer through blocks.py takes beyond those kernels (Python,
allocation, copies), measured once on the device.
Rates are bytes/s and FLOP/s; times seconds.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.blocks import (
    LayerState,
    attention_part,
    mlp_part,
)
from tandem.nodes.prefill.engine import DEFAULT_CHUNK_TOKENS, plan_for_prompts, prompt_activations
from tandem.nodes.prefill.loads import DIRECT_ALIGN, Load, Part
from tandem.nodes.prefill.plan import Plan
from tandem.nodes.prefill.rope import apply_rope, inv_freq, rms_norm, rope_tables
from tandem.nodes.prefill.stream.movers import N_STAGING, CpuMover
from tandem.nodes.prefill.stream.reads import READ_CHUNK, READ_THREADS
from tandem.nodes.prefill.stream.streamer import TORCH_DTYPES, lower_this_thread
from torch.nn.attention.bias import causal_lower_right

log = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]
Bound = Literal["pcie", "disk", "compute"]
DISK_PROBE_BYTES = 192 << 20
COPY_PROBE_BYTES = 256 << 20
PROBE_WEIGHT_BYTES = 128 << 20  # the largest weight a matmul probe allocates


@dataclass(frozen=True)
class Hardware:
    """The machine a plan runs on (rates: bytes/s, FLOP/s) and the Mac it would serve."""

    device: Device
    copy_Bps: float  # host → device (PCIe); CPU: the emulated link, or memcpy
    disk_Bps: float  # cold reads of the weight files (O_DIRECT)
    flops: float  # matmul FLOP/s in the model's compute dtype
    net_Bps: float  # prefill node → decode node
    mac_tok_s: float  # the Mac's own prefill rate (tokens/s)
    attn_flops: float | None = None  # the attention kernel's FLOP/s; None: `flops`
    elementwise_Bps: float | None = None  # activations through norms, RoPE, SwiGLU, adds;
    # None: free beside the matmuls (a GPU's memory-bound ops at TB/s)
    overhead: float = 1.0  # a layer's compute time over its kernels' (`measure_overhead`)


@dataclass(frozen=True)
class Work:
    """What one load computes."""

    matmul: float = 0.0  # FLOPs
    attention: float = 0.0  # FLOPs: scores and weighted values
    elementwise: float = 0.0  # bytes of activations the memory-bound ops go through

    def __add__(self, other: Work) -> Work:
        return Work(
            self.matmul + other.matmul,
            self.attention + other.attention,
            self.elementwise + other.elementwise,
        )

    def seconds(self, hw: Hardware) -> float:
        attn = hw.attn_flops or hw.flops
        elementwise = self.elementwise / hw.elementwise_Bps if hw.elementwise_Bps else 0.0
        return (self.matmul / hw.flops + self.attention / attn + elementwise) * hw.overhead


@dataclass(frozen=True)
class Step:
    """One load as the simulator sees it (seconds)."""

    read_s: float  # disk → host memory (the slot itself on a CPU, staging on CUDA)
    copy_s: float  # host → device; CPU: what the emulated link adds to the fill
    compute_s: float
    streamed: bool  # through the ring; False: resident, already in memory


@dataclass(frozen=True)
class Prediction:
    """One predicted pass over `tokens` new positions after `start`."""

    tokens: int
    start: int
    wall_s: float
    disk_s: float  # sum over streamed loads
    copy_s: float  # sum over streamed loads (host → device)
    compute_s: float  # sum over all loads
    bound: Bound
    bytes_per_pass: int  # streamed through the ring

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.inf


def whole_ops_reserve(
    spec: ModelSpec, tokens: int | None, itemsize: int, device: Device,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> int:  # fmt: skip
    """Bytes a node keeps free for the activations of a `tokens` prompt when it cuts no op
    (what a resident model needs; 0 for None): engine.py's default budget adds it."""
    return prompt_activations(spec, tokens or 0, 0, chunk, itemsize, device, cut_ops=False)


def node_plan(
    index: ModelIndex, budget: int, tokens: int | None = None, device: Device = "cpu"
) -> Plan:
    """The plan a prefill node makes for `budget` bytes, room kept for the activations of a
    `tokens` prompt (engine.plan_for_prompts)."""
    return plan_for_prompts(index, budget, tokens, device)


def attention_pairs(tokens: int, start: int, device: Device, chunk: int) -> int:
    """(query, key) pairs the attention kernel computes per query head, as blocks.py calls
    it: causal from position 0 skips the masked half; CUDA takes all queries at once (the
    fused kernel skips masked blocks), a CPU takes query chunks, each over every key up to
    its last query, masked after the first (the masked pairs are computed too)."""
    if device == "cuda":
        return tokens * start + tokens * (tokens + 1) // 2
    pairs = 0
    for c0 in range(0, tokens, chunk):
        c1 = min(tokens, c0 + chunk)
        if start + c0 == 0:
            pairs += (c1 - c0) * (c1 - c0 + 1) // 2
        else:
            pairs += (c1 - c0) * (start + c1)
    return pairs


def attention_work(
    spec: ModelSpec, nkv: int, tokens: int, pairs: int, first: bool, itemsize: int,
    with_o: bool = True,
) -> Work:  # fmt: skip
    """Attention over `nkv` KV heads for `tokens` positions (`pairs`: `attention_pairs`);
    `with_o`: o_proj too, else the heads' output is kept for the o parts."""
    H, D, T = spec.hidden_size, spec.head_dim, tokens
    nq = nkv * (spec.num_heads // spec.num_kv_heads)
    matmul = 2.0 * T * H * D * ((2 if with_o else 1) * nq + 2 * nkv)  # q, o: nq; k, v: nkv
    attention = 4.0 * D * nq * pairs  # q·k and p·v: 2·D FLOPs each per pair
    # input norm (first part), RoPE of q and k, the residual add (or the output kept)
    elementwise = (T * H if first else 0) + T * (nq + nkv) * D + (T * H if with_o else T * nq * D)
    return Work(matmul, attention, float(elementwise * itemsize))


def mlp_work(
    spec: ModelSpec, cols: int, tokens: int, first: bool, itemsize: int, with_down: bool = True
) -> Work:
    """The MLP over `cols` intermediate features for `tokens` positions; `with_down`:
    down_proj too, else the activation is kept for the down parts."""
    H, T = spec.hidden_size, tokens
    matmul = 2.0 * T * H * cols * (3 if with_down else 2)  # gate, up, down: [T,H]x[H,c]
    kept = T * H if with_down else T * cols  # the residual add, or the activation kept
    elementwise = (T * H if first else 0) + T * cols + kept  # norm, SwiGLU
    return Work(matmul, 0.0, float(elementwise * itemsize))


def out_rows_work(inner: int, rows: int, tokens: int, itemsize: int) -> Work:
    """`rows` rows of o_proj or down_proj (`inner` input features) over the kept output,
    added into `rows` residual columns."""
    return Work(2.0 * tokens * inner * rows, 0.0, float(tokens * rows * itemsize))


def part_work(spec: ModelSpec, part: Part, tokens: int, pairs: int, itemsize: int) -> Work:
    """What one part computes over `tokens` positions (`pairs`: `attention_pairs`)."""
    width = part.hi - part.lo
    if part.op in ("mlp", "gate_up"):
        return mlp_work(spec, width, tokens, part.first, itemsize, part.op == "mlp")
    if part.op == "o":
        return out_rows_work(spec.num_heads * spec.head_dim, width, tokens, itemsize)
    if part.op == "down":
        return out_rows_work(spec.intermediate_size, width, tokens, itemsize)
    return attention_work(spec, width, tokens, pairs, part.first, itemsize, part.op == "attn")


def load_work(
    spec: ModelSpec, load: Load, tokens: int, start: int, device: Device, itemsize: int,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Work:  # fmt: skip
    pairs = attention_pairs(tokens, start, device, chunk)
    return sum((part_work(spec, p, tokens, pairs, itemsize) for p in load.parts), Work())


def steps(
    plan: Plan, index: ModelIndex, tokens: int, hw: Hardware, start: int = 0,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> list[Step]:  # fmt: skip
    """The plan's loads as simulator steps on `hw`."""
    itemsize = ITEMSIZE[index.dtype]
    out = []
    for load in plan.loads:
        work = load_work(index.spec, load, tokens, start, hw.device, itemsize, chunk)
        compute_s = work.seconds(hw)
        if load.resident:
            out.append(Step(0.0, 0.0, compute_s, streamed=False))
            continue
        read_s, copy_s = load.weight_bytes / hw.disk_Bps, load.weight_bytes / hw.copy_Bps
        if hw.device == "cpu":  # the link caps the whole fill, the read included
            copy_s = max(0.0, copy_s - read_s)
        out.append(Step(read_s, copy_s, compute_s, streamed=True))
    return out


def simulate(run: Sequence[Step], n_slots: int, staging: int = 0) -> float:
    """Seconds from the first read to the end of the last compute.

    `staging` = 0: each read lands in its slot and the fill (read, then `copy_s`) holds the
    loader; a slot is released when its compute ends (CPU). `staging` > 0: reads land in
    that many buffers taken in turn, copies run on their own stream after the slot's last
    compute, and a slot is released when its compute is queued (CUDA).
    """
    loader = copy_free = compute_end = 0.0
    released: list[float] = []  # per streamed load: when the loader may refill its slot
    computed: list[float] = []  # per streamed load: when its compute ended
    copied: list[float] = []  # per staged fill: when its copy ended (its buffer is free)
    for step in run:
        if not step.streamed:
            ready = loader  # warm: ready once the loader gets to it
        else:
            prev = len(released) - max(n_slots, 1)  # the slot's previous occupant
            read_start = max(loader, released[prev] if prev >= 0 else 0.0)
            if staging and len(copied) >= staging:
                read_start = max(read_start, copied[-staging])
            read_end = read_start + step.read_s
            if staging:
                slot_free = computed[prev] if prev >= 0 else 0.0
                ready = max(read_end, copy_free, slot_free) + step.copy_s
                copy_free = ready
                copied.append(ready)
                loader = read_end
            else:
                ready = loader = read_end + step.copy_s
        begin = max(ready, compute_end)
        compute_end = begin + step.compute_s
        if step.streamed:
            released.append(begin if staging else compute_end)
            computed.append(compute_end)
    return compute_end


def predict(
    plan: Plan, index: ModelIndex, tokens: int, hw: Hardware, start: int = 0,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Prediction:  # fmt: skip
    """Predicted warm pass of `tokens` new positions after `start` through `plan` on `hw`."""
    run = steps(plan, index, tokens, hw, start, chunk)
    nbytes = sum(ld.weight_bytes for ld in plan.loads if not ld.resident)
    wall = simulate(run, plan.n_slots, N_STAGING if hw.device == "cuda" else 0)
    disk_s, copy_s = nbytes / hw.disk_Bps, nbytes / hw.copy_Bps
    compute_s = sum(s.compute_s for s in run)
    bound: Bound = "disk" if disk_s >= copy_s else "pcie"
    if compute_s >= max(disk_s, copy_s):
        bound = "compute"
    return Prediction(tokens, start, wall, disk_s, copy_s, compute_s, bound, nbytes)


def break_even_tokens(
    remote_s: Callable[[int], float], local_s: Callable[[int], float], limit: int
) -> int | None:
    """The shortest prompt (tokens, up to `limit`) whose remote prefill is predicted faster
    than the local one, or None: doubles from 1, then bisects the last step."""
    faster = lambda n: remote_s(n) < local_s(n)  # noqa: E731
    lo, hi = 0, 1  # not faster at lo (0: nothing checked), faster at hi once found
    while not faster(hi):
        if hi >= limit:
            return None
        lo, hi = hi, min(2 * hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if faster(mid) else (mid, hi)
    return hi


# --- calibration: this machine, in a few seconds ------------------------------------------


def _rate(
    work: float, fn: Callable[[], object], device: torch.device, seconds: float, windows: int = 5
) -> float:
    """`work` units per second of `fn`: one warm-up call, then the best of `windows` windows
    of calls over about `seconds` in all (the best: a shared machine only ever slows it)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    best = 0.0
    for _ in range(windows):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds / windows:
                break
        best = max(best, work * calls / elapsed)
    return best


def _matmul(device: Device, dtype: str, hidden: int) -> tuple[Callable[[], object], float]:
    """A [512, hidden] x [hidden, 4·hidden] matmul in `dtype` (safetensors name) on `device`,
    the MLP's shape (the weight capped at `PROBE_WEIGHT_BYTES`), and its FLOPs."""
    dev, tdtype, c = torch.device(device), TORCH_DTYPES[dtype], DEFAULT_CHUNK_TOKENS
    cols = max(1, min(4 * hidden, PROBE_WEIGHT_BYTES // (hidden * ITEMSIZE[dtype])))
    x = torch.randn(c, hidden, device=dev).to(tdtype)
    w = torch.randn(cols, hidden, device=dev).to(tdtype)

    def run() -> object:
        with torch.inference_mode():
            return F.linear(x, w)

    return run, 2.0 * c * hidden * cols


def measure_flops(device: Device, dtype: str, hidden: int, seconds: float = 0.5) -> float:
    """Matmul FLOP/s in `dtype` on `device` (`_matmul`)."""
    run, flops = _matmul(device, dtype, hidden)
    return _rate(flops, run, torch.device(device), seconds)


def measure_attention_flops(
    device: Device, dtype: str, spec: ModelSpec, seconds: float = 0.5
) -> float:
    """FLOP/s of the attention kernel as blocks.py calls it, with the model's heads: a
    causal chunk from position 0, then (CPU) a masked chunk after it, or (CUDA) all queries
    at once; FLOPs counted as `attention_pairs` does."""
    dev, tdtype, c = torch.device(device), TORCH_DTYPES[dtype], DEFAULT_CHUNK_TOKENS
    nkv = min(spec.num_kv_heads, 4)  # a few KV groups are enough for a rate
    nq, D = nkv * (spec.num_heads // spec.num_kv_heads), spec.head_dim
    T = 2 * c
    q = torch.randn(1, nq, T, D, device=dev).to(tdtype)
    k = torch.randn(1, nkv, T, D, device=dev).to(tdtype)
    v = torch.randn(1, nkv, T, D, device=dev).to(tdtype)
    sdpa = F.scaled_dot_product_attention

    def run() -> None:
        if dev.type == "cuda":
            sdpa(q, k, v, is_causal=True, enable_gqa=True)
            return
        sdpa(q[:, :, :c], k[:, :, :c], v[:, :, :c], is_causal=True, enable_gqa=True)
        mask = causal_lower_right(c, T)
        sdpa(q[:, :, c:], k, v, attn_mask=mask, enable_gqa=True)  # type: ignore[arg-type]

    pairs = attention_pairs(T, 0, device, c)
    with torch.inference_mode():
        return _rate(4.0 * D * nq * pairs, run, dev, seconds)


def measure_elementwise_Bps(
    device: Device, dtype: str, spec: ModelSpec, seconds: float = 0.3
) -> float:
    """Activation bytes/s of one layer's memory-bound ops on a chunk of tokens, as blocks.py
    runs them (two norms, RoPE on q and k, SwiGLU, two residual adds), counted as
    `attention_work` and `mlp_work` do."""
    dev, tdtype, c = torch.device(device), TORCH_DTYPES[dtype], DEFAULT_CHUNK_TOKENS
    H, D, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    heads = spec.num_heads + spec.num_kv_heads
    h = torch.randn(c, H, device=dev).to(tdtype)
    weight = torch.ones(H, device=dev).to(tdtype)
    qk = torch.randn(heads, c, D, device=dev).to(tdtype)
    cos, sin = torch.rand(c, D, device=dev), torch.rand(c, D, device=dev)
    gate, up = (torch.randn(c, inter, device=dev).to(tdtype) for _ in range(2))

    def run() -> None:
        for _ in range(2):  # attention's and the MLP's input norm and residual add
            h.add_(rms_norm(h, weight, spec.rms_norm_eps), alpha=0.0)
        apply_rope(qk, cos, sin)
        _ = F.silu(gate) * up

    work = (2 * c * H + 2 * c * H + c * heads * D + c * inter) * ITEMSIZE[dtype]
    with torch.inference_mode():
        return _rate(float(work), run, dev, seconds)


def _layer_slice(
    spec: ModelSpec, dev: torch.device, dtype: torch.dtype, cols: int
) -> dict[str, torch.Tensor]:
    """Random weights of one KV group's attention and `cols` MLP columns of a layer."""
    H, D = spec.hidden_size, spec.head_dim
    nq = spec.num_heads // spec.num_kv_heads

    def mat(rows: int, n: int) -> torch.Tensor:
        return (torch.randn(rows, n, device=dev) * n**-0.5).to(dtype)

    w = {
        "input_layernorm.weight": torch.ones(H, device=dev, dtype=dtype),
        "post_attention_layernorm.weight": torch.ones(H, device=dev, dtype=dtype),
        "self_attn.q_proj.weight": mat(nq * D, H),
        "self_attn.k_proj.weight": mat(D, H),
        "self_attn.v_proj.weight": mat(D, H),
        "self_attn.o_proj.weight": mat(H, nq * D),
        "mlp.gate_proj.weight": mat(cols, H),
        "mlp.up_proj.weight": mat(cols, H),
        "mlp.down_proj.weight": mat(H, cols),
    }
    if spec.attention_bias:
        for name, n in (("q", nq * D), ("k", D), ("v", D)):
            w[f"self_attn.{name}_proj.bias"] = torch.zeros(n, device=dev, dtype=dtype)
    if spec.qk_norm:
        for name in ("q", "k"):
            w[f"self_attn.{name}_norm.weight"] = torch.ones(D, device=dev, dtype=dtype)
    return w


def measure_overhead(
    device: Device, dtype: str, spec: ModelSpec, flops: float, attn_flops: float,
    elementwise_Bps: float, seconds: float = 0.5, tokens: int = 2 * DEFAULT_CHUNK_TOKENS,
) -> float:  # fmt: skip
    """A layer's compute time through blocks.py over what its kernels take at the measured
    rates (`Work.seconds`): a slice of one layer of the model's shape (one KV group, up to
    `PROBE_WEIGHT_BYTES` of MLP columns) over `tokens` positions. Best-of timings on both
    sides, so a shared machine moves the ratio little."""
    dev, tdtype, itemsize = torch.device(device), TORCH_DTYPES[dtype], ITEMSIZE[dtype]
    H, T, chunk = spec.hidden_size, tokens, DEFAULT_CHUNK_TOKENS
    cols = max(1, min(spec.intermediate_size, PROBE_WEIGHT_BYTES // (3 * H * itemsize)))
    w = _layer_slice(spec, dev, tdtype, cols)
    rope = rope_tables(inv_freq(spec), 0, T, dev)
    h0 = torch.randn(T, H, device=dev).to(tdtype)
    kv = (1, spec.num_kv_heads, T, spec.head_dim)

    def run() -> None:
        h = h0.clone()
        state = LayerState(torch.empty(kv, device=dev, dtype=tdtype),
                           torch.empty(kv, device=dev, dtype=tdtype))  # fmt: skip
        attention_part(spec, h, state, w, kv_lo=0, kv_hi=1, first=True, start=0, rope=rope,
                       chunk=chunk)  # fmt: skip
        mlp_part(spec, h, state, w, first=True, chunk=chunk, hi=cols)

    pairs = attention_pairs(T, 0, device, chunk)
    work = attention_work(spec, 1, T, pairs, True, itemsize) + mlp_work(
        spec, cols, T, True, itemsize
    )
    rates = Hardware(device, 1.0, 1.0, flops, 1.0, 1.0, attn_flops, elementwise_Bps)
    with torch.inference_mode():
        measured = 1.0 / _rate(1.0, run, dev, seconds)
    return min(max(measured / work.seconds(rates), 0.5), 3.0)  # a bound on what noise does


def measure_copy_Bps(device: Device, nbytes: int = COPY_PROBE_BYTES, seconds: float = 0.3) -> float:
    """Host → device bytes/s from pinned memory (CUDA), or memcpy bytes/s (CPU)."""
    dev = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst.fill_(0)
    return _rate(nbytes, lambda: dst.copy_(src, non_blocking=True), dev, seconds)


def _write_probe(fd: int, nbytes: int) -> None:
    """Fill an open file with `nbytes` of incompressible bytes, on disk, out of the cache."""
    block = os.urandom(1 << 20)
    for off in range(0, nbytes, len(block)):
        os.write(fd, block[: nbytes - off])
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _read_probe(path: Path, nbytes: int, nice: int = 0) -> float:
    """Seconds to read the file once as movers.py reads weights: O_DIRECT where the file
    system allows it, `READ_CHUNK` reads, `READ_THREADS` in flight, at niceness `nice`."""
    buf = torch.zeros(nbytes + DIRECT_ALIGN, dtype=torch.uint8)  # touched, as slots are
    skip = -buf.data_ptr() % DIRECT_ALIGN  # O_DIRECT: an aligned address
    mem = memoryview(buf[skip : skip + nbytes].numpy()).cast("B")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        os.preadv(fd, [mem[:DIRECT_ALIGN]], 0)
    except OSError:  # O_DIRECT refused here: through the page cache (dropped after writing)
        fd = os.open(path, os.O_RDONLY)

    def read(lo: int) -> None:
        view, off = mem[lo : min(nbytes, lo + READ_CHUNK)], lo
        while len(view):
            n = os.preadv(fd, [view], off)
            if n <= 0:
                raise OSError(f"short read at offset {off}")
            view, off = view[n:], off + n

    try:
        if nice:
            lower_this_thread(nice)  # the pool's threads start from here: they inherit it
        with ThreadPoolExecutor(READ_THREADS) as pool:
            t0 = time.perf_counter()
            list(pool.map(read, range(0, nbytes, READ_CHUNK)))
            return time.perf_counter() - t0
    finally:
        os.close(fd)


def _beside(busy: Callable[[], object], fn: Callable[[], float]) -> float:
    """`fn()` on a thread of its own while `busy()` runs in a loop on this one."""
    out: list[float] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # raised again on the calling thread
            errors.append(e)

    thread = threading.Thread(target=target, name="tandem-disk-probe")
    thread.start()
    while thread.is_alive():
        busy()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def measure_disk_Bps(
    directory: Path | None = None, nbytes: int = DISK_PROBE_BYTES,
    busy: Callable[[], object] | None = None, nice: int = 0,
) -> float:  # fmt: skip
    """Cold read bytes/s of a file written in `directory` (the weights' file system; the
    temp dir where that is not writable), read back uncached; the file is removed. With
    `busy`, read at niceness `nice` while `busy()` keeps the cores computing: what a CPU
    loader gets beside compute."""
    for where in (directory, None):
        try:
            fd, name = tempfile.mkstemp(prefix=".tandem-disk-probe-", dir=where)
        except OSError:
            continue
        path = Path(name)
        try:
            try:
                _write_probe(fd, nbytes)
            finally:
                os.close(fd)
            if busy is None:
                return nbytes / _read_probe(path, nbytes)
            return nbytes / _beside(busy, lambda p=path: _read_probe(p, nbytes, nice))
        finally:
            path.unlink(missing_ok=True)
    raise OSError("no writable directory for the disk probe")


def calibrate(
    device: Device, dtype: str, spec: ModelSpec, *, net_Bps: float, mac_tok_s: float,
    directory: Path | None = None, disk_bytes: int = DISK_PROBE_BYTES,
    copy_bytes: int = COPY_PROBE_BYTES, seconds: float = 0.5,
) -> Hardware:  # fmt: skip
    """This machine's rates for `spec` in `dtype`: matmul, attention and elementwise compute,
    host → device copy, disk (a few seconds; `seconds` per compute probe). On a CPU the disk
    is read as the loader reads it there, beside compute at the loader's niceness."""
    flops = measure_flops(device, dtype, spec.hidden_size, seconds)
    attn = measure_attention_flops(device, dtype, spec, seconds)
    elementwise = measure_elementwise_Bps(device, dtype, spec, seconds / 2)
    hw = Hardware(
        device=device,
        copy_Bps=measure_copy_Bps(device, copy_bytes, seconds / 2),
        disk_Bps=measure_disk_Bps(directory, disk_bytes, *loader_contention(device, dtype, spec)),
        flops=flops,
        net_Bps=net_Bps,
        mac_tok_s=mac_tok_s,
        attn_flops=attn,
        elementwise_Bps=elementwise,
        overhead=measure_overhead(device, dtype, spec, flops, attn, elementwise, seconds),
    )
    log.info("calibrated %s", hw)
    return hw


def loader_contention(
    device: Device, dtype: str, spec: ModelSpec
) -> tuple[Callable[[], object] | None, int]:
    """What a loader reads beside (`measure_disk_Bps`'s `busy` and `nice`): on a CPU, the
    model's matmuls on every core, the loader niced as `CpuMover.loader_nice`; on CUDA
    nothing (the loader has the host to itself, not lowered)."""
    if device != "cpu":
        return None, 0
    return _matmul(device, dtype, spec.hidden_size)[0], CpuMover.loader_nice
