"""The `families` and `dequant` sections (issue 48): what only a GPU shows of every family and
of dequantization.

- `families`: for each family the node serves (Llama, Gemma 3's windows, Qwen3-MoE routed,
  Qwen3.5's linear layers, Qwen3.5-MoE, gpt-oss, GLM-4.x MoE, DeepSeek V3), a made model in
  bf16 streamed at a third of its bytes (routed loads, the RAM tier off) on the device
  against the CPU: every layer's K/V or state; and for the mixtures of experts the expert
  loads' time per pass and their aten ops (a few dozen a load whatever it chose).
- `dequant`: a 70B-wide matrix dequantized at 3, 4 and 6 bits: the torch path's kernels
  launched (≤ 12) and its time, median of 5; and (`triton`) the Triton kernel's time on the
  same matrix, and that it gives the torch path's bits.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .compare import BF16_REL
from .context import Ctx, attempt, say
from .models import tokens
from .sizes import Json

SHAPES: dict[str, Json] = {
    "llama": {"arch": "llama"},
    "gemma3": {"arch": "gemma3", "sliding_window": 64},
    "qwen3_moe": {"arch": "qwen3_moe", "experts": 32, "top_k": 4, "moe_intermediate": 256},
    "qwen3_5": {"arch": "qwen3_5", "layout": "hf"},
    "qwen3_5_moe": {"arch": "qwen3_5_moe", "experts": 32, "top_k": 4, "moe_intermediate": 256,
                    "shared_intermediate": 256},
    # sinks (one more key in flash attention, head dim 72), windows, biased experts, YaRN
    "gpt_oss": {"arch": "gpt_oss", "experts": 32, "top_k": 4, "moe_intermediate": 256,
                "sliding_window": 128, "rope_scaling": "yarn"},
    # the noaux_tc router over groups, a shared expert; DeepSeek's latent attention (its SDPA
    # has values narrower than its keys: which kernel CUDA picks is worth seeing)
    "glm4_moe": {"arch": "glm4_moe", "experts": 32, "top_k": 4, "moe_intermediate": 256,
                 "n_group": 4, "topk_group": 2},
    "deepseek_v3": {"arch": "deepseek_v3", "experts": 32, "top_k": 4, "moe_intermediate": 256,
                    "n_group": 4, "topk_group": 2, "kv_lora_rank": 128, "q_lora_rank": 128,
                    "rope_head_dim": 32, "nope_head_dim": 64, "v_head_dim": 64,
                    "rope_scaling": "yarn"},
}  # fmt: skip


def _made(ctx: Ctx, name: str) -> Path:
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    out = ctx.work / f"family-{name}"
    if not out.is_dir():
        wide = {"hidden": 512, "heads": 8, "kv_heads": 2, "head_dim": 64, "intermediate": 1024,
                "vocab": 1024} if ctx.cuda else {"hidden": 64, "vocab": 512}  # fmt: skip
        args = {"layers": 4, "dtype": "bfloat16", **wide, **SHAPES[name]}
        make_model(out, MakeModelArgs(**args))
    return out


def _flat(items: list[Any]) -> list[Any]:
    """Each handover's tensors in order (K, V; or a state's by name)."""
    from tandem.nodes.prefill.handover import LayerKV

    out: list[Any] = []
    for item in items:
        out += [item.k, item.v] if isinstance(item, LayerKV) else [
            item.tensors[n] for n in sorted(item.tensors)
        ]  # fmt: skip
    return out


def family_case(ctx: Ctx, name: str) -> Json:
    from tandem.nodes.model.index import load_index
    from tandem.nodes.prefill.engine import PrefillEngine
    from tandem.nodes.prefill.families import qwen3_moe

    index = load_index(_made(ctx, name))
    budget = index.total_bytes // 3
    ids = tokens(ctx.sizes.kv_tokens * 4, index.spec.vocab_size, seed=7)
    timed: list[tuple[float, int]] = []  # (seconds, ops) per expert load
    real = qwen3_moe.compute_experts

    def counted(p: Any, parts: Any, views: Any, state: Any, h: Any) -> None:
        import torch

        ops = _Ops()
        if h.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ops:
            real(p, parts, views, state, h)
        if h.is_cuda:
            torch.cuda.synchronize()
        timed.append((time.perf_counter() - t0, ops.count))

    qwen3_moe.compute_experts = counted
    try:
        ref = PrefillEngine(index, budget=budget, device="cpu", host_budget=0)
        try:
            want = _flat(list(ref.prefill(ids)))
        finally:
            ref.close()
        test = PrefillEngine(index, budget=budget, device=ctx.device, host_budget=0)
        try:
            list(test.prefill(ids))  # warm
            timed.clear()
            got = _flat(list(test.prefill(ids)))
            plan = test.plan
        finally:
            test.close()
    finally:
        qwen3_moe.compute_experts = real
    worst = max(((a.float().cpu() - b.float().cpu()).abs().max() / max(1e-6, a.abs().max().item()))
                .item() for a, b in zip(want, got, strict=True))  # fmt: skip
    out: Json = {"layers": index.spec.num_layers, "tokens": len(ids), "n_slots": plan.n_slots,
                 "routed_loads": sum(ld.routed for ld in plan.loads), "max_rel": worst,
                 "ok": worst <= BF16_REL}  # fmt: skip
    if timed:
        out["expert_loads_per_pass"] = len(timed)
        out["experts_s_per_pass"] = round(sum(t for t, _ in timed), 4)
        out["max_ops_per_load"] = max(n for _, n in timed)
        out["ok"] = out["ok"] and out["max_ops_per_load"] <= 80
    say(f"family {name}: max rel {worst:.2e}" + (f", experts {out['experts_s_per_pass']} s, "
        f"≤ {out['max_ops_per_load']} ops a load" if timed else ""))  # fmt: skip
    return out


class _Ops:
    """Counts the aten ops that are not views, under a dispatch mode."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:  # fmt: skip
                if not func.is_view:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self._mode = 0, Mode()

    def __enter__(self) -> _Ops:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def families_section(ctx: Ctx) -> Json:
    """Every family on the device against the CPU (see the module doc)."""
    out: Json = {name: attempt(family_case, ctx, name) for name in SHAPES}
    out["ok"] = all(v.get("ok") for v in out.values() if isinstance(v, dict))
    return out


def dequant_case(ctx: Ctx, bits: int) -> Json:
    import torch
    from tandem.nodes.model.quant import Quant
    from tandem.nodes.prefill.kernels.dequant import dequantize, temp_bytes_per_row

    rows, cols = (8192, 8192) if ctx.cuda else (64, 1024)
    words = packed(rows, cols, bits).to(ctx.device)
    scales = torch.rand(rows, cols // 64, dtype=torch.bfloat16, device=ctx.device)
    biases = torch.randn(rows, cols // 64, dtype=torch.bfloat16, device=ctx.device)
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=ctx.device)
    per_row = temp_bytes_per_row(cols, bits, scales.dtype, torch.bfloat16)
    temp = torch.empty(rows * per_row + 256, dtype=torch.uint8, device=ctx.device)
    quant = Quant(bits, 64)
    ops = _Ops()
    with ops:  # the torch path (on CUDA `dequantize` takes the Triton kernel where it can)
        dequantize(words, scales, biases, quant, torch.bfloat16, out, temp, triton=False)
    s = _median(ctx, lambda: dequantize(words, scales, biases, quant, torch.bfloat16, out, temp,
                                        triton=False))  # fmt: skip
    say(f"dequant {bits}-bit {rows}x{cols}: {ops.count} ops, {s * 1e3:.2f} ms")
    fast = attempt(dequant_triton_case, ctx, bits, (words, scales, biases), out, s)
    return {"rows": rows, "cols": cols, "ops": ops.count, "median_s": s,
            "GBps_out": rows * cols * 2 / s / 1e9, "triton": fast,
            "ok": ops.count <= 12 and fast.get("ok") is not False}  # fmt: skip


def dequant_triton_case(
    ctx: Ctx, bits: int, parts: tuple[Any, ...], want: Any, torch_s: float
) -> Json:
    """The Triton kernel on the same matrix: the torch path's bits (`want`), its time, and
    how much faster it is."""
    if not ctx.cuda:
        return {"ok": None, "skipped": "needs CUDA"}
    import torch

    try:
        from tandem.nodes.prefill.kernels import dequant_triton
    except ImportError:
        return {"ok": None, "skipped": "triton is not installed"}
    if not dequant_triton.usable(want.device):
        return {"ok": False, "error": "triton is installed but its kernel does not run here"}
    words, scales, biases = parts
    rows, cols = want.shape
    out = torch.full_like(want, float("nan"))

    def run() -> None:
        dequant_triton.dequantize_affine(words, scales, biases, bits, 64, out, torch.bfloat16)

    run()  # compiled here, once a width
    same = torch.equal(out.view(torch.int16), want.view(torch.int16))
    s = _median(ctx, run)
    bits_said = "the same bits" if same else "OTHER BITS than the torch path"
    say(f"dequant {bits}-bit {rows}x{cols} triton: {s * 1e3:.2f} ms "
        f"({torch_s / s:.1f}x the torch path), {bits_said}")  # fmt: skip
    return {"median_s": s, "GBps_out": rows * cols * 2 / s / 1e9, "speedup": torch_s / s,
            "same_bits": same, "ok": same}  # fmt: skip


def _median(ctx: Ctx, fn: Any, n: int = 5) -> float:
    """`fn`'s time, median of `n` runs (on CUDA, each to its end)."""
    import torch

    times = []
    for _ in range(n):
        if ctx.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if ctx.cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def packed(rows: int, cols: int, bits: int) -> Any:
    """Random `bits`-bit values [rows, cols] packed as MLX packs them: little-endian, from the
    low bits up, 8 values in `bits` bytes; int32 words [rows, cols·bits/32]."""
    import numpy as np
    import torch

    q = np.random.default_rng(bits).integers(0, 1 << bits, (rows, cols // 8, 8), dtype=np.int64)
    group = (q << (bits * np.arange(8, dtype=np.int64))).sum(-1)  # [R, C/8], 8·bits bits
    raw = group.astype("<i8").view(np.uint8).reshape(rows, cols // 8, 8)[..., :bits]
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1).view(np.int32))


def dequant_section(ctx: Ctx) -> Json:
    out: Json = {f"{bits}bit": attempt(dequant_case, ctx, bits) for bits in (3, 4, 6)}
    out["ok"] = all(v.get("ok") for v in out.values() if isinstance(v, dict))
    return out
