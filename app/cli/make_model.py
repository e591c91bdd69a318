"""`tandem make-model DIR`: a tiny random-weight model in HF format (or MLX-quantized)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("tandem")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a tiny random-weight HF-format model")
    p.add_argument("dir", type=Path)
    p.add_argument(
        "--arch",
        choices=[
            "llama", "qwen3", "qwen2", "mistral", "gemma3", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
            "gpt_oss", "glm4_moe", "deepseek_v3",
        ],
        default="llama",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=176)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rope-scaling", choices=["none", "llama3", "yarn"], default="none")
    p.add_argument(
        "--rope-theta", type=float, default=None,
        help="RoPE base (default: the family's: 1e4; Gemma 3's global layers 1e6)",
    )  # fmt: skip
    p.add_argument("--sliding-window", type=int, default=8, help="gemma3: a sliding layer's window")
    p.add_argument(
        "--sliding-window-pattern", type=int, default=3,
        help="gemma3: every pattern-th layer attends to every position",
    )  # fmt: skip
    p.add_argument("--tie-embeddings", action="store_true")
    _add_moe_options(p)
    _add_qwen3_5_options(p)
    _add_deepseek_options(p)
    p.add_argument(
        "--quantize", type=int, default=None, metavar="BITS",
        help="an MLX quantized checkpoint instead, by mlx-lm's converter (2-8 bits)",
    )  # fmt: skip
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument(
        "--q-mode", choices=["affine", "mxfp4", "mxfp8", "nvfp4"], default="affine",
        help="mlx quantization mode; mxfp4 and nvfp4 imply --quantize 4, mxfp8 8, each with its "
        "own group size (32, 16, 32)",
    )  # fmt: skip
    p.add_argument("--recipe", default=None, help="mlx-lm mixed recipe, e.g. mixed_3_6")
    p.set_defaults(func=run)


def _add_moe_options(p: argparse.ArgumentParser) -> None:
    """qwen3_moe's options (nodes/model/factory_moe.py)."""
    p.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per routed layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts each token uses")
    p.add_argument("--moe-intermediate", type=int, default=64, help="qwen3_moe: an expert's width")
    p.add_argument(
        "--decoder-sparse-step", type=int, default=1,
        help="qwen3_moe: layer i routes where (i + 1) is a multiple of this",
    )  # fmt: skip
    p.add_argument(
        "--mlp-only-layers", type=_layer_list, default=(), metavar="I,J",
        help="qwen3_moe: layers given a dense MLP instead of experts",
    )  # fmt: skip
    p.add_argument(
        "--norm-topk-prob", action=argparse.BooleanOptionalAction, default=True,
        help="qwen3_moe: renormalise the top-k router weights to sum to 1",
    )  # fmt: skip
    p.add_argument(
        "--expert-layout", choices=["stacked", "per-expert"], default="stacked",
        help="qwen3_moe: mlx-community's stacked [E, out, in] or Hugging Face's one by one",
    )  # fmt: skip
    p.add_argument(
        "--router-bias", type=float, default=0.0, metavar="B",
        help="qwen3_moe: > 0 sends most tokens to experts 0..top-k-1 (1: nearly all), so a "
        "short prompt uses few experts",
    )  # fmt: skip


def _add_qwen3_5_options(p: argparse.ArgumentParser) -> None:
    """qwen3_5's and qwen3_5_moe's options (nodes/model/factory_qwen3_5.py)."""
    p.add_argument(
        "--layout", choices=["mlx", "hf"], default="mlx",
        help="qwen3_5: mlx-lm's saved names, or Hugging Face's (norms less one, conv [C,1,K], "
        "experts fused)",
    )  # fmt: skip
    p.add_argument(
        "--full-attention-interval", type=int, default=4,
        help="qwen3_5: layer i is full attention where (i + 1) is a multiple of this, else linear",
    )  # fmt: skip
    p.add_argument("--linear-k-heads", type=int, default=2, help="qwen3_5: linear key heads")
    p.add_argument("--linear-v-heads", type=int, default=4, help="qwen3_5: linear value heads")
    p.add_argument("--linear-k-dim", type=int, default=32, help="qwen3_5: a linear key head's dim")
    p.add_argument(
        "--linear-v-dim", type=int, default=32, help="qwen3_5: a linear value head's dim"
    )
    p.add_argument("--conv-kernel", type=int, default=4, help="qwen3_5: the linear layers' conv")
    p.add_argument(
        "--shared-intermediate", type=int, default=64, help="qwen3_5_moe: the shared expert's width"
    )


def _add_deepseek_options(p: argparse.ArgumentParser) -> None:
    """The DeepSeek-V3 lineage's options: glm4_moe and deepseek_v3 (routing, shared experts),
    deepseek_v3's multi-head latent attention."""
    p.add_argument("--first-dense", type=int, default=1, help="layers 0..N-1 keep a dense MLP")
    p.add_argument("--n-group", type=int, default=1, help="expert groups (noaux_tc routing)")
    p.add_argument("--topk-group", type=int, default=1, help="groups a token chooses within")
    p.add_argument("--shared-experts", type=int, default=1, help="n_shared_experts")
    p.add_argument("--routed-scaling", type=float, default=1.0, help="routed_scaling_factor")
    p.add_argument("--partial-rotary", type=float, default=0.5, help="glm4_moe: RoPE's share")
    p.add_argument("--qk-norm", action="store_true", help="glm4_moe: use_qk_norm")
    p.add_argument("--kv-lora-rank", type=int, default=32, help="deepseek_v3: the latent's width")
    p.add_argument("--q-lora-rank", type=int, default=48, help="deepseek_v3: 0 for a whole q_proj")
    p.add_argument("--rope-head-dim", type=int, default=16, help="deepseek_v3: qk_rope_head_dim")
    p.add_argument("--nope-head-dim", type=int, default=32, help="deepseek_v3: qk_nope_head_dim")
    p.add_argument("--v-head-dim", type=int, default=32, help="deepseek_v3: v_head_dim")


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of layer numbers: {text!r}") from None


def _bits(a: argparse.Namespace) -> int | None:
    """--quantize, or the bits an fp --q-mode implies."""
    from tandem.nodes.model.quant import FP_MODES

    if a.quantize is None and a.q_mode in FP_MODES:
        return FP_MODES[a.q_mode][0]
    return a.quantize


def run(a: argparse.Namespace) -> int:
    """Write the model; print its directory."""
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    args = MakeModelArgs(
        arch=a.arch,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate=a.intermediate,
        vocab=a.vocab,
        dtype=a.dtype,
        shards=a.shards,
        seed=a.seed,
        rope_scaling=a.rope_scaling,
        rope_theta=a.rope_theta,
        sliding_window=a.sliding_window,
        sliding_window_pattern=a.sliding_window_pattern,
        tie_embeddings=a.tie_embeddings,
        quantize=_bits(a),
        group_size=a.group_size,
        recipe=a.recipe,
        experts=a.experts,
        top_k=a.top_k,
        moe_intermediate=a.moe_intermediate,
        decoder_sparse_step=a.decoder_sparse_step,
        mlp_only_layers=a.mlp_only_layers,
        norm_topk_prob=a.norm_topk_prob,
        expert_layout=a.expert_layout,
        router_bias=a.router_bias,
        layout=a.layout,
        full_attention_interval=a.full_attention_interval,
        linear_k_heads=a.linear_k_heads,
        linear_v_heads=a.linear_v_heads,
        linear_k_dim=a.linear_k_dim,
        linear_v_dim=a.linear_v_dim,
        conv_kernel=a.conv_kernel,
        shared_intermediate=a.shared_intermediate,
        first_dense=a.first_dense,
        n_group=a.n_group,
        topk_group=a.topk_group,
        shared_experts=a.shared_experts,
        routed_scaling=a.routed_scaling,
        partial_rotary=a.partial_rotary,
        qk_norm=a.qk_norm,
        kv_lora_rank=a.kv_lora_rank,
        q_lora_rank=a.q_lora_rank,
        rope_head_dim=a.rope_head_dim,
        nope_head_dim=a.nope_head_dim,
        v_head_dim=a.v_head_dim,
        q_mode=a.q_mode,
    )
    out = make_model(a.dir, args)
    log.info("wrote %s", out)
    print(out)
    return 0
