"""This machine's rates for the cost model (`work.Hardware`), measured in a few seconds.

Every probe runs what the prefill really runs, at the model's shapes and dtype: a matmul of
the MLP's shape, the attention kernel as blocks.py calls it, a linear-attention layer's gated
delta rule, a layer's memory-bound ops, a slice of one layer through blocks.py
(`measure_overhead`), a quantized model's dequantization, the host → device copy; the disk
is read as the loader reads it (`disk_probe.py`). Rates are bytes/s and FLOP/s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.dtypes import TORCH_DTYPES
from tandem.nodes.prefill.engine import DEFAULT_CHUNK_TOKENS
from tandem.nodes.prefill.kernels.blocks import (
    LayerState,
    attention_part,
    mlp_part,
)
from tandem.nodes.prefill.kernels.dequant import BLOCK_BYTES, dequantize, temp_bytes_per_row
from tandem.nodes.prefill.kernels.gated_delta import gated_delta_chunked
from tandem.nodes.prefill.kernels.linear_mixer import RULE_CHUNK, decay, normalize_qk
from tandem.nodes.prefill.kernels.rope import apply_rope, inv_freq, rms_norm, rope_tables
from tandem.nodes.prefill.planning.disk_probe import DISK_PROBE_BYTES, measure_disk_Bps
from tandem.nodes.prefill.planning.work import (
    Device,
    Hardware,
    attention_pairs,
    attention_work,
    mlp_work,
    recurrence_work,
)
from tandem.nodes.prefill.stream.movers import CpuMover
from torch.nn.attention.bias import causal_lower_right

log = logging.getLogger(__name__)

COPY_PROBE_BYTES = 256 << 20
PROBE_WEIGHT_BYTES = 128 << 20  # the largest weight a matmul probe allocates


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


def measure_recurrence_flops(
    device: Device, dtype: str, spec: ModelSpec, seconds: float = 0.3
) -> float | None:
    """FLOP/s of the gated delta rule (`gated_delta_chunked`) on a block of the engine's
    chunk with the model's linear heads, counted as `work.recurrence_work`; None for a model
    without linear layers. Decays as mlx-lm initialises a layer (A uniform in (0, 16), here
    its heads' quantiles; dt_bias 1; a ~ N(0, 1)): on a CPU the products of the larger ones
    fall into float32 denormals, which slow the rule several-fold (a made model's A moves
    the rate by ±15%)."""
    lin = spec.linear
    if lin is None:
        return None
    dev, tdtype, c = torch.device(device), TORCH_DTYPES[dtype], DEFAULT_CHUNK_TOKENS
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = normalize_qk(rand(c, lin.num_k_heads, lin.head_k_dim),
                        rand(c, lin.num_k_heads, lin.head_k_dim), lin.head_k_dim**-0.5)  # fmt: skip
    v = F.silu(rand(c, lin.num_v_heads, lin.head_v_dim))
    A = 16 * (torch.arange(lin.num_v_heads) + 0.5) / lin.num_v_heads  # uniform's quantiles
    g = decay(A.log(), rand(c, lin.num_v_heads), torch.ones(lin.num_v_heads))
    beta = torch.sigmoid(rand(c, lin.num_v_heads))
    q, k, v, beta = (x.to(dev, tdtype) for x in (q, k, v, beta))  # g: float32, as the mixer's
    g = g.to(dev)
    state = torch.zeros(lin.num_v_heads, lin.head_v_dim, lin.head_k_dim, device=dev)
    with torch.inference_mode():
        state = gated_delta_chunked(q, k, v, g, beta, state, RULE_CHUNK)[1]  # a carried one
        run = lambda: gated_delta_chunked(q, k, v, g, beta, state, RULE_CHUNK)  # noqa: E731
        return _rate(recurrence_work(lin, c, c), run, dev, seconds)


def measure_dequant_Bps(
    device: Device, dtype: str, spec: ModelSpec, seconds: float = 0.3
) -> float | None:
    """Bytes/s of weights dequantized into `dtype` (`dequant.dequantize`, its temporaries
    in lent scratch as the plan lends them) for a matrix of the MLP's shape, capped at
    `PROBE_WEIGHT_BYTES`, at the model's default quantization; None for a float model."""
    quants = [spec.quantization.default, *spec.quantization.overrides.values()]
    quant = next((q for q in quants if q is not None), None)
    if quant is None:
        return None
    dev, tdtype, H = torch.device(device), TORCH_DTYPES[dtype], spec.hidden_size
    cols = H // quant.group_size * quant.group_size
    rows = max(1, min(spec.intermediate_size, PROBE_WEIGHT_BYTES // (cols * ITEMSIZE[dtype])))
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, quant.packed_cols(cols)), generator=gen,
                          dtype=torch.int32).to(dev)  # fmt: skip
    scales = (torch.rand(rows, quant.groups(cols), generator=gen) * 0.01).to(dev, tdtype)
    biases = (torch.randn(rows, quant.groups(cols), generator=gen) * 0.01).to(dev, tdtype)
    out = torch.empty(rows, cols, dtype=tdtype, device=dev)
    per_row = temp_bytes_per_row(cols, quant.bits, tdtype, tdtype)
    temp = torch.empty(max(per_row, min(per_row * rows, BLOCK_BYTES)), dtype=torch.uint8,
                       device=dev)  # fmt: skip

    def run() -> object:
        with torch.inference_mode():
            return dequantize(words, scales, biases, quant, tdtype, out, temp)

    return _rate(float(rows * cols * ITEMSIZE[dtype]), run, dev, seconds)


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
    if spec.attention_sinks:
        w["self_attn.sinks"] = torch.zeros(spec.num_heads, device=dev, dtype=dtype)
    if spec.output_bias:
        w["self_attn.o_proj.bias"] = torch.zeros(H, device=dev, dtype=dtype)
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


def calibrate(
    device: Device, dtype: str, spec: ModelSpec, *, net_Bps: float, mac_tok_s: float,
    directory: Path | None = None, disk_bytes: int = DISK_PROBE_BYTES,
    copy_bytes: int = COPY_PROBE_BYTES, seconds: float = 0.5,
) -> Hardware:  # fmt: skip
    """This machine's rates for `spec` in `dtype`: matmul, attention, the delta rule (a model
    with linear layers), elementwise compute and dequantization (a quantized model), host →
    device copy, disk (a few seconds; `seconds` per compute probe). On a CPU the disk
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
        recurrence_flops=measure_recurrence_flops(device, dtype, spec, seconds / 2),
        dequant_Bps=measure_dequant_Bps(device, dtype, spec, seconds / 2),
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
