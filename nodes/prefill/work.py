"""What one load of a plan computes, and how long that takes at given rates.

A load computes its matmuls at `flops`, its attention kernel at `attn_flops`, and the rest
(norms, RoPE, SwiGLU, residual adds: memory-bound) at `elementwise_Bps` of activations,
all times `overhead`: what one layer through blocks.py takes beyond those kernels (Python,
allocation, copies), measured once on the device (`calibration.measure_overhead`).
Rates are bytes/s and FLOP/s; times seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.engine import DEFAULT_CHUNK_TOKENS
from tandem.nodes.prefill.loads import Load, Part

Device = Literal["cpu", "cuda"]


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
    if part.op == "router" and spec.moe is not None:  # hidden → experts
        return out_rows_work(spec.hidden_size, spec.moe.num_experts, tokens, itemsize)
    if part.op == "experts" and spec.moe is not None:  # its share of the routed tokens
        moe = spec.moe
        routed = math.ceil(tokens * moe.experts_per_token * width / moe.num_experts)
        return mlp_work(spec, moe.intermediate_size, routed, False, itemsize, True)
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
    """What `load` computes over `tokens` new positions after `start` (blocks.py's calls)."""
    pairs = attention_pairs(tokens, start, device, chunk)
    return sum((part_work(spec, p, tokens, pairs, itemsize) for p in load.parts), Work())
