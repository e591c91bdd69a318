"""Device bytes of activations while a layer computes: the reserve a plan keeps beside the
weights for the longest prompt it takes (`budget.prompt_activations`), as the kernels in
`kernels/blocks.py` and their neighbours hold them. Shapes as there: T new tokens, S keys, H
hidden, D head_dim."""

from __future__ import annotations

from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.kernels.blocks import fused_attention
from tandem.nodes.prefill.prefix_upload import AHEAD as PREFIX_AHEAD

CUDA_SLACK = (1.25, 256 << 20)  # ×, + bytes: cuBLAS workspaces, allocator rounding, rope tables


def math_attention_bytes(nq: int, nkv: int, c: int, S: int, D: int, itemsize: int) -> int:
    """Peak bytes SDPA's MATH kernel (torch 2.13) holds for c queries over S keys. It works
    in float32 whatever the input: K and V widened, then repeated to every query head (GQA),
    K scaled (a third K-sized buffer, until the scores are made), q widened and scaled, the
    mask in the input dtype; then score-sized buffers [nq, c, S]. Its peak is the larger of
    two moments: the scores' product with the three K/V-sized buffers alive, or two score
    buffers (masked scores, their softmax) beside K (scaled) and V. Measured op by op on the
    CPU for four shapes (tests/test_activation_reserve.py)."""
    fp32 = 4
    widened = 2 * nkv * S * D * fp32  # K and V in float32, before the repeat
    kv = nq * S * D * fp32  # one of K, K scaled, V repeated to every query head
    scores = nq * c * S * fp32
    queries = 2 * nq * c * D * fp32  # q in float32, and scaled
    peak = max(3 * kv + scores, 2 * kv + 2 * scores)
    return widened + peak + queries + c * S * itemsize


def activation_bytes(
    spec: ModelSpec,
    count: int,
    start: int,
    chunk: int,
    itemsize: int,
    device_type: str = "cpu",
    cut_ops: bool = True,
) -> int:
    """Upper bound on device bytes of activations while one layer computes, for `count` new
    tokens after `start`, as `attention_part` computes them on a `device_type` device: all
    queries at once through a fused kernel that never holds the score matrix
    (`fused_attention`), else query chunks of `chunk` with [heads, chunk, S] scores. On CUDA
    also the previous layer's K/V still on its way to the host, and `CUDA_SLACK`. `cut_ops`:
    the plan cuts an op into row ranges, whose output is kept across its parts."""
    cuda = device_type == "cuda"
    T, S, H, D = count, start + count, spec.hidden_size, spec.head_dim
    nq, nkv = spec.num_heads, spec.num_kv_heads
    c = min(chunk, T)
    kv = 2 * nkv * S * D * itemsize  # the layer's K/V
    base = 2 * T * H * itemsize + kv + 2 * T * D * 4  # h, x_norm, K/V, rope tables (fp32)
    if cut_ops:
        base += T * max(nq * D, spec.intermediate_size) * itemsize  # a cut op's kept output
    qkv = T * (nq + 2 * nkv) * D * itemsize
    rope = 3 * c * nq * D * 4  # float32 copies of one chunk of q
    if fused_attention(device_type, itemsize, D):
        attn = qkv + max(rope, 2 * T * nq * D * itemsize + T * H * itemsize)  # out, o_proj
    else:  # on CUDA SDPA may take its MATH kernel (a pre-Ampere card): count what it holds
        scores = (
            math_attention_bytes(nq, nkv, c, S, D, itemsize) if cuda else 2 * nq * c * S * itemsize
        )
        attn = qkv + max(rope, scores + c * (nq * D + H) * itemsize)
    windows = [k.window for k in spec.layer_kinds if k.window is not None]
    if windows:  # sliding layers: their rope tables, query chunks over the band and its mask
        base += 2 * T * D * 4
        keys = min(S, c + max(windows) - 1)
        band = (2 * nq * itemsize + 1) * c * keys  # scores and the boolean band
        if cuda:  # the keys repeated to every query head (`band_attention`), and the mask
            # as the efficient kernel's bias; where SDPA may still take MATH (a pre-Ampere
            # card, fp32), its worst case
            band += 2 * nq * keys * D * itemsize + c * keys * itemsize
            if not fused_attention(device_type, itemsize, D):
                band = max(band, math_attention_bytes(nq, nq, c, keys, D, itemsize))
        attn = max(attn, qkv + max(rope, band + c * (nq * D + H) * itemsize))
    if cuda:
        base += kv  # the previous layer's K/V until its copy to the host is done
        base += PREFIX_AHEAD * 2 * nkv * start * D * itemsize  # prefixes on their way in
    mlp = c * (3 * spec.intermediate_size + H) * itemsize
    if spec.post_norms:  # a branch's output [c, H] and its float32 norm; cut: kept [T, H]
        base += T * H * itemsize if cut_ops else 0
        attn, mlp = attn + 3 * c * H * 4, mlp + 3 * c * H * 4
    if spec.moe is not None:  # a sparse layer: its routes and float32 sum of the experts'
        # outputs; one expert's SwiGLU over every token at worst (a token picks each once)
        base += T * H * 4 + T * spec.moe.experts_per_token * (8 + itemsize)
        mlp = max(mlp, T * (2 * H + 2 * spec.moe.intermediate_size) * itemsize + T * H * 4)
    if (m := spec.mla) is not None:  # every head's keys and values decompressed, q, scores
        widths = m.q_dim + m.v_dim + m.nope_dim  # keys, values, keys before the rope joins
        attn = nq * (S * widths + T * (m.q_dim + m.v_dim) + 2 * c * S) * itemsize
    if spec.attention_sinks:  # gpt-oss: the queries, keys and values copied a dim wider
        dp, q_at_once = -(-(D + 1) // 8) * 8, T if fused_attention(device_type, itemsize, D) else c
        attn += (q_at_once * nq + 2 * nkv * (S + 1)) * dp * itemsize
    if spec.attn_output_gate:  # Qwen3.5: q_proj's gate rows, kept beside the queries
        attn += T * nq * D * itemsize + c * nq * D * itemsize
    if spec.linear is not None:
        attn = max(attn, linear_mixer_bytes(spec, T, c, itemsize))
    total = base + max(attn, mlp)
    if cuda:
        return int(total * CUDA_SLACK[0]) + CUDA_SLACK[1]
    return total


def linear_mixer_bytes(spec: ModelSpec, T: int, c: int, itemsize: int) -> int:
    """A linear-attention layer's mixer (`linear_mixer.py`) in blocks of c tokens: its output
    [T, H]; per block the projections, the conv's input and float32 sum, q/k/v, z and the
    gated norm's float32 copies; the delta rule's per-chunk [Hv, 64, 64] matrices and [Hv,
    64, D] pseudo-values in float32; the old and new recurrent state."""
    lin = spec.linear
    assert lin is not None
    C, Hv, Dmax = lin.conv_dim, lin.num_v_heads, max(lin.head_k_dim, lin.head_v_dim)
    block = c * C * (3 * itemsize + 2 * 4) + c * lin.value_dim * (itemsize + 3 * 4)
    rule = 6 * c * Hv * 64 * 4 + 4 * c * Hv * Dmax * 4
    return (
        T * spec.hidden_size * itemsize
        + block
        + rule
        + 2 * Hv * lin.head_v_dim * lin.head_k_dim * 4
    )
