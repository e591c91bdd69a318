"""What one load of a plan computes, and how long that takes at given rates.

A load computes its matmuls at `flops`, its attention kernel at `attn_flops`, a linear-
attention layer's gated delta rule at `recurrence_flops`, and the rest (norms, RoPE, SwiGLU,
the mixer's conv and gated norm, residual adds: memory-bound) at `elementwise_Bps` of
activations, all times `overhead`: what one layer through blocks.py takes beyond those kernels
(Python, allocation, copies), measured once on the device (`calibration.measure_overhead`).
A quantized model's weights are dequantized where the plan does so (`dequant_work`), at
`dequant_Bps`. Each part's work is what its family computes (blocks.py, linear_mixer.py,
gated_delta.py, families/qwen3_moe.py and qwen3_5.py). Rates are bytes/s and FLOP/s; times
seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.qwen3_5_config import LinearSpec
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.engine import DEFAULT_CHUNK_TOKENS
from tandem.nodes.prefill.kernels.linear_mixer import RULE_CHUNK
from tandem.nodes.prefill.planning.loads import Load, Part, dequantized_bytes

Device = Literal["cpu", "cuda"]
FLOAT32 = 4  # bytes: the mixer's conv, norms and delta rule, the experts' sum
# bytes/s of weights made in the compute dtype where none is measured: CUDA, a 4090's
# (Llama-3-70B at 4 bits, 137 GB of bfloat16 weights dequantized per pass: +1.4 s, issue 48);
# a CPU, this project's 2-core Xeon's (calibration.measure_dequant_Bps)
DEQUANT_Bps: dict[Device, float] = {"cuda": 1e11, "cpu": 2e9}


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
    recurrence_flops: float | None = None  # the gated delta rule's (`recurrence_work`): small
    # float32 batched matmuls and a triangular solve; None: `flops`
    dequant_Bps: float | None = None  # weights dequantized, bytes of the compute dtype made;
    # None: `DEQUANT_Bps` of the device


@dataclass(frozen=True)
class Work:
    """What one load computes."""

    matmul: float = 0.0  # FLOPs
    attention: float = 0.0  # FLOPs: scores and weighted values
    elementwise: float = 0.0  # bytes of activations the memory-bound ops go through
    recurrence: float = 0.0  # FLOPs: the gated delta rule (`recurrence_work`)
    dequant: float = 0.0  # bytes of weights dequantized (the compute dtype)

    def __add__(self, other: Work) -> Work:
        return Work(
            self.matmul + other.matmul,
            self.attention + other.attention,
            self.elementwise + other.elementwise,
            self.recurrence + other.recurrence,
            self.dequant + other.dequant,
        )

    def seconds(self, hw: Hardware) -> float:
        attn = hw.attn_flops or hw.flops
        rule = hw.recurrence_flops or hw.flops
        elementwise = self.elementwise / hw.elementwise_Bps if hw.elementwise_Bps else 0.0
        kernels = self.matmul / hw.flops + self.attention / attn + self.recurrence / rule
        dequant = self.dequant / (hw.dequant_Bps or DEQUANT_Bps[hw.device])
        return (kernels + elementwise) * hw.overhead + dequant


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
    `with_o`: o_proj too, else the heads' output is kept for the o parts. A gated output
    (Qwen3.5, `attn_output_gate`): q_proj's rows twice over, the heads times sigmoid(gate)."""
    H, D, T = spec.hidden_size, spec.head_dim, tokens
    nq = nkv * (spec.num_heads // spec.num_kv_heads)
    q = 2 * nq if spec.attn_output_gate else nq  # q_proj's rows, in heads
    matmul = 2.0 * T * H * D * ((1 if with_o else 0) * nq + q + 2 * nkv)  # q, o; k, v: nkv
    attention = 4.0 * D * nq * pairs  # q·k and p·v: 2·D FLOPs each per pair
    # input norm (first part), RoPE of q and k, the residual add (or the output kept); the
    # gate's sigmoid and product
    elementwise = (T * H if first else 0) + T * (nq + nkv) * D + (T * H if with_o else T * nq * D)
    elementwise += 2 * T * nq * D if spec.attn_output_gate else 0
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


def router_work(spec: ModelSpec, tokens: int, itemsize: int) -> Work:
    """A sparse layer's router (`qwen3_moe._route`): the post-attention norm, the gate
    [T, H] x [H, E], its float32 softmax and top-k, and the experts' float32 sum zeroed; the
    DeepSeek-V3 lineage's (`deepseek_moe.route`, sigmoid scores) also a biased copy of the
    scores, and where experts come in groups, the groups' scores and the zeroed groups."""
    moe = spec.moe
    assert moe is not None
    H, E, T = spec.hidden_size, moe.num_experts, tokens
    per_expert = itemsize + 2 * FLOAT32
    if moe.scoring == "sigmoid":
        per_expert += 2 * FLOAT32 * (2 if moe.groups > 1 else 1)
    elementwise = T * H * (itemsize + FLOAT32) + T * E * per_expert
    return Work(2.0 * T * H * E, 0.0, float(elementwise))


def shared_work(spec: ModelSpec, cols: int, tokens: int, itemsize: int, gated: bool = True) -> Work:
    """A shared expert: a SwiGLU MLP `cols` wide over every token, its output widened and
    added into the experts' float32 sum; `gated` (Qwen3.5-MoE's, `qwen3_5._shared`) also its
    gate [T, H] x [H, 1] and the output scaled by sigmoid(gate) (the DeepSeek-V3 lineage's
    shared experts have none: `deepseek_moe.shared_experts`)."""
    H, T = spec.hidden_size, tokens
    elementwise = T * cols * itemsize + T * H * (itemsize + (2 if gated else 1) * FLOAT32)
    return Work(2.0 * T * H * (3 * cols + (1 if gated else 0)), 0.0, float(elementwise))


def recurrence_work(lin: LinearSpec, tokens: int, block: int) -> float:
    """FLOPs of the gated delta rule in its chunked form (`gated_delta_chunked`) over
    `tokens` positions, which the mixer hands it in blocks of `block`, each padded to whole
    chunks of C = `RULE_CHUNK`. Per value head and chunk: K·Kᵀ and Q·Kᵀ (2·C²·Dk each), the
    unit-triangular solve for U0 and W (C²·(Dv + Dk)), the chunk's attention times U
    (2·C²·Dv), and the state's three products W·Sᵀ, Q·Sᵀ, Uᵀ·K (2·C·Dk·Dv each)."""
    C, Dk, Dv = RULE_CHUNK, lin.head_k_dim, lin.head_v_dim
    chunks = sum(-(-min(block, tokens - b0) // C) for b0 in range(0, tokens, block))
    per_chunk = C * C * (5 * Dk + 3 * Dv) + 6 * C * Dk * Dv
    return float(lin.num_v_heads * chunks * per_chunk)


def linear_work(spec: ModelSpec, tokens: int, itemsize: int, block: int) -> Work:
    """A linear-attention layer's mixer (`linear_mixer.py`) over `tokens` positions in blocks
    of `block`: linear in tokens, whatever the prefix. The projections (qkv, z, b, a; out),
    the delta rule (`recurrence_work`), and per token the input norm, the causal conv (its
    input joined to the carried rows, widened, K taps summed in float32, narrowed) and SiLU,
    q and k normalised in float32, the gated norm in float32, out_proj's output written and
    added into h."""
    lin = spec.linear
    assert lin is not None
    H, C, V, s = spec.hidden_size, lin.conv_dim, lin.value_dim, itemsize
    matmul = 2.0 * tokens * H * (C + 2 * V + 2 * lin.num_v_heads)
    per_token = (
        3 * H * s
        + C * (3 * s + FLOAT32 * (lin.conv_kernel + 1))
        + 2 * lin.key_dim * (s + FLOAT32)
        + V * (s + 3 * FLOAT32)
    )
    return Work(
        matmul, elementwise=float(tokens * per_token),
        recurrence=recurrence_work(lin, tokens, block),
    )  # fmt: skip


def part_work(
    spec: ModelSpec, part: Part, tokens: int, pairs: int, itemsize: int,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Work:  # fmt: skip
    """What one part computes over `tokens` positions (`pairs`: `attention_pairs`; `chunk`:
    the engine's token chunk, a linear mixer's block)."""
    width = part.hi - part.lo
    match part.op:
        case "router":  # hidden → experts
            return router_work(spec, tokens, itemsize)
        case "experts":  # its share of the routed tokens
            assert spec.moe is not None
            moe = spec.moe
            routed = math.ceil(tokens * moe.experts_per_token * width / moe.num_experts)
            return mlp_work(spec, moe.intermediate_size, routed, False, itemsize, True)
        case "shared":
            gated = any(pc.key.startswith("mlp.shared_expert_gate.") for pc in part.pieces)
            return shared_work(spec, width, tokens, itemsize, gated)
        case "linear":  # all value heads, or a rank's share of them (`ranks/shard.py`)
            lin = spec.linear
            assert lin is not None
            if width < lin.num_v_heads:
                g = lin.num_v_heads // lin.num_k_heads
                lin = replace(lin, num_k_heads=width // g, num_v_heads=width)
            return linear_work(replace(spec, linear=lin), tokens, itemsize, chunk)
        case "mlp" | "gate_up":
            return mlp_work(spec, width, tokens, part.first, itemsize, part.op == "mlp")
        case "o":
            return out_rows_work(spec.num_heads * spec.head_dim, width, tokens, itemsize)
        case "down":
            return out_rows_work(spec.intermediate_size, width, tokens, itemsize)
        case "attn" | "qkv":
            return attention_work(
                spec, width, tokens, pairs, part.first, itemsize, part.op == "attn"
            )
    raise ValueError(f"no work model for a {part.op!r} part")


def load_work(
    spec: ModelSpec, load: Load, tokens: int, start: int, device: Device, itemsize: int,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Work:  # fmt: skip
    """What `load` computes over `tokens` new positions after `start` (blocks.py's calls)."""
    pairs = attention_pairs(tokens, start, device, chunk)
    return sum((part_work(spec, p, tokens, pairs, itemsize, chunk) for p in load.parts), Work())


# parts whose matrices a scratch too small for all of them dequantizes once per token chunk:
# each chunk asks for each matrix again, and the next one overwrites it (dequant.py)
PER_CHUNK = frozenset({"mlp", "gate_up", "linear", "shared"})


def dequant_work(
    index: ModelIndex, load: Load, tokens: int, scratch: int, itemsize: int,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Work:  # fmt: skip
    """The weights a quantized `load` dequantizes in a pass over `tokens` positions, in
    bytes of the compute dtype (`itemsize`), into a `scratch` of that many bytes: each part's
    matrices once (`dequant.DequantizedWeights` keeps them while they fit; o_proj's and
    down_proj's rows go through a small one in blocks, once); where the scratch holds fewer,
    an MLP's, a mixer's or a shared expert's again per token chunk; each expert only where
    a token chose it (`MoeSpec.expected_share`), once. Call it for the loads a pass
    dequantizes: the streamed ones, and the resident ones the plan keeps packed (not in
    `Plan.resident_floats`). Not modelled: a scratch that lends `dequantize` room for only a
    row or so of temporaries beside a matrix (`scratch.temp_room` of a tight plan) makes it go
    a few rows at a time, a few kernels each (~25 µs a block on a 2-core CPU: 4x the bytes'
    time for a made 4-bit model)."""
    moe = index.spec.moe
    share = moe.expected_share(tokens) if moe is not None else 1.0
    total = 0.0
    for part in load.parts:
        nbytes = dequantized_bytes(index, part, itemsize)
        if part.op == "experts":
            total += nbytes * share
        elif part.op in PER_CHUNK and nbytes > scratch:
            total += nbytes * math.ceil(tokens / chunk)
        else:
            total += nbytes
    return Work(dequant=total)
