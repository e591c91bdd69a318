"""The `quantized` section: an MLX 4-bit model, and K/V quantized for the wire (`kv_bits` 8
and 4), on the device against the CPU.

The 4-bit model is written here with torch (the CUDA box may have no mlx): make_model's float
model, each linear and embedding matrix through `kv_quant.quantize` (`mx.quantize`'s affine
layout: uint32 words packed from the low bits up, scales and biases per group), and
`quantization: {group_size, bits}` in config.json, as mlx-lm writes it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .compare import BF16_REL, compare, judged
from .context import Ctx, attempt, say
from .engines import engine_at, streamed_budget
from .models import small_model, tokens
from .sizes import Json

WEIGHT_BITS, WEIGHT_GROUP = 4, 64
SAME_INPUT_SLACK = 1e-3  # share of values whose level may differ, quantizing the same K/V


def quantize_model(
    src: Path, out: Path, bits: int = WEIGHT_BITS, group: int = WEIGHT_GROUP
) -> Path:
    """`src` (a float make_model directory) as an MLX affine `bits`-bit model in `out`."""
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from tandem.nodes.model.safetensors_format import RawTensor, encode_parts
    from tandem.nodes.prefill.dtypes import SAFETENSORS_DTYPES
    from tandem.nodes.prefill.kernels.kv_quant import quantize

    def raw(t: torch.Tensor) -> RawTensor:
        t = t.contiguous()
        if t.dtype == torch.uint32:
            dtype, t = "U32", t.view(torch.int32)
        else:
            dtype = SAFETENSORS_DTYPES[t.dtype]
            t = t.view(torch.int16) if t.element_size() == 2 else t
        return RawTensor(dtype, tuple(t.shape), memoryview(t.numpy().reshape(-1).view(np.uint8)))

    out.mkdir(parents=True)
    for path in sorted(src.glob("*.safetensors")):
        tensors: dict[str, RawTensor] = {}
        for name, w in load_file(str(path)).items():
            if w.dim() == 2 and name.endswith(".weight"):  # linear layers and embeddings
                words, scales, biases = quantize(w, group, bits)  # [R, C·bits/32], [R, C/group]
                module = name.removesuffix(".weight")
                tensors |= {name: raw(words), f"{module}.scales": raw(scales),
                            f"{module}.biases": raw(biases)}  # fmt: skip
            else:
                tensors[name] = raw(w)
        with open(out / path.name, "wb") as f:
            for part in encode_parts(tensors, {"format": "mlx"}):
                f.write(part)
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": group, "bits": bits}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = src / "model.safetensors.index.json"
    if index.exists():
        mapping = json.loads(index.read_text())["weight_map"]
        weight_map: dict[str, str] = {}
        for name, file in mapping.items():
            weight_map[name] = file
            if name.endswith(".weight") and not name.endswith("norm.weight"):
                module = name.removesuffix(".weight")
                weight_map |= {f"{module}.scales": file, f"{module}.biases": file}
        text = json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))})
        (out / index.name).write_text(text)
    return out


def levels(parts: dict[str, Any], name: str, bits: int) -> Any:
    """The quantized values of `name` ("k" or "v") as uint8 [..., D], unpacked from the words
    (int32 or uint32, values from the low bits up)."""
    import torch

    words = parts[name].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    q = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, 32/bits]
    return q.flatten(-2).to(torch.uint8)


def compare_quantized(ref: list[Any], got: list[Any], bits: int) -> Json:
    """Wire K/V of two prefills: the share of values whose level differs at all, the largest
    level difference, and the dequantized values' largest difference over the largest value."""
    differ = total = worst = 0
    max_abs = scale = 0.0
    for a, b in zip(ref, got, strict=True):
        if a.quantized is None or b.quantized is None:
            return {"error": f"layer {a.layer}: no quantized K/V"}
        for name in ("k", "v"):
            qa, qb = levels(a.quantized, name, bits), levels(b.quantized, name, bits)
            d = (qa.int() - qb.int()).abs()
            differ, total = differ + int((d > 0).sum()), total + d.numel()
            worst = max(worst, int(d.max()))
            x, y = (dequantized(p.quantized, name, bits) for p in (a, b))
            max_abs = max(max_abs, (x - y).abs().max().item())
            scale = max(scale, x.abs().max().item())
    rel = max_abs / scale if scale else 0.0
    return {"values": total, "differ_share": differ / max(total, 1), "max_level_diff": worst,
            "max_rel": rel}  # fmt: skip


def requantized_on_cpu(got: list[Any], fmt: Any) -> list[Any]:
    """The device's K/V (as handed over, on the host) quantized again by the CPU's kernels:
    the same input, so the device's words should be these."""
    from tandem.nodes.prefill.kernels.kv_quant import quantize

    out = []
    for kv in got:
        parts: dict[str, Any] = {}
        for name, x in (("k", kv.k), ("v", kv.v)):
            words, scales, biases = quantize(x, fmt.group_size, fmt.bits, kernel=fmt.kernel)
            parts |= {name: words, f"{name}_scales": scales, f"{name}_biases": biases}
        out.append(type(kv)(kv.layer, kv.k, kv.v, parts))
    return out


def dequantized(parts: dict[str, Any], name: str, bits: int) -> Any:
    """scales · q + biases of `name`, float32 [..., D]."""
    q = levels(parts, name, bits).float()
    scales = parts[f"{name}_scales"].float()
    biases = parts[f"{name}_biases"].float()
    group = q.shape[-1] // scales.shape[-1]
    grouped = q.unflatten(-1, (scales.shape[-1], group))
    return (grouped * scales.unsqueeze(-1) + biases.unsqueeze(-1)).flatten(-2)


def pair(
    ctx: Ctx, index: Any, budget: int, ids: list[int], fmt: Any = None
) -> tuple[list[Any], list[Any]]:
    """The same prefill on the device (at `budget`) and on the CPU (CUDA), or on the CPU at
    `budget` and all resident (the smoke run): (reference, device)."""
    ref_budget = budget if ctx.cuda else index.total_bytes
    out = []
    for device, b in (("cpu", ref_budget), (ctx.device, budget)):
        engine = engine_at(index, b, device, ctx.sizes.chunk)
        try:
            out.append(list(engine.prefill(ids, kv_format=fmt)))
        finally:
            engine.close()
    return out[0], out[1]


def kv_bits_case(ctx: Ctx, index: Any, bits: int, dtype: str) -> Json:
    """The 4-bit model streamed on the device against the CPU, K/V quantized for the wire to
    `bits`: the K/V themselves (judged as `dtype`) and their quantized values."""
    from tandem.nodes.contract.http import KVFormat

    fmt = KVFormat(bits, min(64, index.spec.head_dim))
    ids = tokens(ctx.sizes.kv_tokens, index.spec.vocab_size, seed=4 + bits)
    ref, got = pair(ctx, index, streamed_budget(index), ids, fmt)
    kv = judged(compare(ref, got), dtype)
    # across devices the K/V differ by rounding: the dequantized values within that, plus a step
    wire = {"bits": bits, "group_size": fmt.group_size, **compare_quantized(ref, got, bits)}
    wire["ok"] = "error" not in wire and wire["max_rel"] <= BF16_REL + 1 / (2**bits - 1)
    # the same K/V quantized by the device and by the CPU: the same words
    same = compare_quantized(requantized_on_cpu(got, fmt), got, bits)
    same["ok"] = "error" not in same and same["max_level_diff"] <= 1
    same["ok"] = same["ok"] and same["differ_share"] <= SAME_INPUT_SLACK
    return {"kv": kv, "wire": wire, "same_input": same}


def quantized_section(ctx: Ctx) -> Json:
    """An MLX 4-bit model with `kv_bits` 8 and 4, on the device against the CPU (smoke: the
    CPU streamed against the CPU all resident)."""
    import torch
    from tandem.nodes.model import load_index

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(max(1, (os.cpu_count() or 4) // 4))  # it runs beside other sections
    dtype = "bfloat16" if ctx.cuda else "float32"  # a CPU without native bf16 is ~47x slower
    shape = {**ctx.sizes.kv_model, "layers": 3}  # streamed: a ring of at least one slot
    float_model = small_model(ctx, "quantized-float", shape, dtype)
    index = load_index(quantize_model(float_model, ctx.work / "quantized-4bit"))
    out: Json = {
        "weights": {"bits": WEIGHT_BITS, "group_size": WEIGHT_GROUP, "dtype": dtype},
        "kv_bits_8": attempt(kv_bits_case, ctx, index, 8, dtype),
        "kv_bits_4": attempt(kv_bits_case, ctx, index, 4, dtype),
    }
    for name in ("kv_bits_8", "kv_bits_4"):
        e = out[name]
        e["ok"] = "error" not in e and all(e[k]["ok"] for k in ("kv", "wire", "same_input"))
        say(f"quantized {name}: ok={e['ok']} K/V {e.get('kv', {}).get('max_rel')}, levels "
            f"differ {e.get('wire', {}).get('differ_share')}")  # fmt: skip
    out["devices"] = f"{ctx.device} vs cpu"
    return {**out, "ok": out["kv_bits_8"]["ok"] and out["kv_bits_4"]["ok"]}
