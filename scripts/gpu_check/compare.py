"""K/V agreement between two prefills, judged against the `cuda` tests' bounds."""

from __future__ import annotations

from typing import Any

from .sizes import Json

FP32_ATOL = 1e-4  # K/V, fp32: max abs difference (the `cuda` tests' bound)
BF16_REL = 5e-2  # K/V, bf16: max abs difference over max abs value; catches garbage, not rounding


def compare(ref: list[Any], got: list[Any]) -> Json:
    """Per-layer K/V agreement: max abs difference, and that over the largest value."""
    if [kv.layer for kv in got] != [kv.layer for kv in ref]:
        return {"error": f"layers {[kv.layer for kv in got]}, expected {[kv.layer for kv in ref]}"}
    max_abs = scale = 0.0
    for a, b in zip(ref, got, strict=True):
        for x, y in ((a.k, b.k), (a.v, b.v)):
            if x.shape != y.shape:
                return {"error": f"layer {a.layer}: shape {tuple(y.shape)}, not {tuple(x.shape)}"}
            x, y = x.float(), y.float()
            max_abs = max(max_abs, (x - y).abs().max().item())
            scale = max(scale, x.abs().max().item())
    rel = max_abs / scale if scale else 0.0
    return {"layers": len(ref), "max_abs": max_abs, "max_rel": rel}


def agrees(cmp: Json, dtype: str) -> bool:
    if "error" in cmp:
        return False
    if dtype == "float32":
        return cmp["max_abs"] <= FP32_ATOL  # NaN compares False
    return cmp["max_rel"] <= BF16_REL


def judged(cmp: Json, dtype: str) -> Json:
    return {**cmp, "ok": agrees(cmp, dtype)}
