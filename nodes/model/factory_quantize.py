"""`tandem make-model --quantize BITS` (or `--recipe`, `--q-mode`): the float model quantized by
mlx-lm's own converter. mlx is imported here only (DESIGN.md layout)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tandem.nodes.model import factory_gpt_oss as gpt_oss
from tandem.nodes.model import factory_qwen3_5 as qwen3_5
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.factory import MakeModelArgs, make_model, replace_dir
from tandem.nodes.model.factory_moe import sparse_layers


def quantize_model(out_dir: str | Path, args: MakeModelArgs) -> Path:
    """The float model of `args`, quantized by mlx-lm's own converter (`mlx_lm.convert`):
    `args.quantize` bits in groups of `args.group_size`, or a mixed `args.recipe`, in mode
    `args.q_mode` (an fp mode: its own bits and group size); scales and float weights in
    `args.dtype`. mlx is imported here only (DESIGN.md layout)."""
    import tempfile

    from mlx_lm import convert
    from tandem.nodes.model.quant import FP_MODES, MODES

    out = Path(out_dir)
    bits, group = args.quantize, args.group_size
    if args.q_mode not in MODES:
        raise ModelError(f"--q-mode must be one of {', '.join(MODES)}, not {args.q_mode!r}")
    if args.q_mode in FP_MODES:
        bits, group = FP_MODES[args.q_mode]
        if args.quantize not in (None, bits):
            raise ModelError(f"--q-mode {args.q_mode} stores {bits} bits, not {args.quantize}")
    else:
        if args.quantize is not None and args.quantize not in (2, 3, 4, 5, 6, 8):
            raise ModelError(
                f"--quantize must be one of 2, 3, 4, 5, 6, 8 bits, not {args.quantize}"
            )
        if args.group_size not in (32, 64, 128):
            raise ModelError(f"--group-size must be 32, 64 or 128, not {args.group_size}")
    sparse = sparse_layers(args)
    widths = [args.hidden] + ([args.intermediate] if not all(sparse) else [])
    widths += [args.moe_intermediate] if any(sparse) else []
    if args.arch in qwen3_5.ARCHS:  # its own layers' widths
        widths = qwen3_5.qwen3_5_widths(args, args.head_dim or args.hidden // args.heads)
    if args.arch == "deepseek_v3":  # every input width mlx-lm quantizes, per-head ones too
        widths = [args.hidden, args.q_lora_rank, args.kv_lora_rank, args.nope_head_dim,
                  args.heads * args.v_head_dim, args.moe_intermediate,
                  args.intermediate]  # fmt: skip
    if args.arch == "glm4_moe":  # o_proj's input is heads × head dim; dense first layers
        head_dim = args.head_dim or args.hidden // args.heads
        widths = [args.hidden, args.heads * head_dim, args.moe_intermediate]
        widths += [args.intermediate] if args.first_dense else []
    if args.arch == gpt_oss.ARCH:  # every layer routes; o_proj's input is heads × head dim
        widths = [args.hidden, args.heads * (args.head_dim or 0), args.moe_intermediate]
    if any(w % group for w in widths):
        raise ModelError(
            "--hidden, --intermediate (dense layers) and --moe-intermediate (routed layers) (and "
            "Qwen3.5's heads x head dim, linear value width) must be multiples of --group-size "
            f"({group}; an fp --q-mode's own)"
        )
    if args.layout != "mlx":
        raise ModelError("a quantized model is written in the mlx layout only (--layout mlx)")
    float_args = dataclasses.replace(args, quantize=None, recipe=None)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        src = make_model(Path(tmp) / "float", float_args)
        dest = Path(tmp) / "quantized"
        try:
            convert(
                str(src),
                str(dest),
                quantize=True,
                q_bits=bits,
                q_group_size=group,
                q_mode=args.q_mode,
                dtype=args.dtype,
                quant_predicate=args.recipe,
            )
        except ValueError as e:
            raise ModelError(f"mlx-lm cannot quantize this model: {e}") from None
        replace_dir(dest, out)
    return out
