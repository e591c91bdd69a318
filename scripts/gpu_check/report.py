"""The report: issue 17's numbers picked out of the sections, as strict JSON on stdout and in
$OUT/gpu-check.json."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .sizes import Json


def clean(x: Any) -> Any:
    """JSON-safe: NaN and infinities become None (strict JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return x


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def summarize(sections: Json, smoke: bool) -> Json:
    """The numbers issue 17 asks for, picked out of the sections (its bounds are judged on
    CUDA only: the smoke run's numbers are too small to mean anything)."""
    h2d, bench = sections.get("h2d", {}), sections.get("bench", {})
    pinned = (h2d.get("pinned") or {}).get("best_Bps")
    warm = (bench.get("loader") or {}).get("warm") or {}
    card = sections.get("small_card", {})
    kv, attn = sections.get("kv", {}), sections.get("attention", {})
    copy_ratio, overlap = ratio(warm.get("copy_Bps"), pinned), bench.get("overlap_ratio")
    targets = {  # issue 17's bounds; None where the number is missing
        "loader copy / pinned peak >= 0.9": None if copy_ratio is None else copy_ratio >= 0.9,
        "overlap_ratio <= 1.10": None if overlap is None else overlap <= 1.10,
        "no OOM at 8k tokens, 6 GiB budget": None if card.get("oom") is None else not card["oom"],
    }
    return {
        "targets": "not judged in a smoke run" if smoke else targets,
        "pinned_h2d_Bps": pinned,
        "loader_copy_Bps": warm.get("copy_Bps"),
        "loader_copy_over_pinned": copy_ratio,
        "loader_end_to_end_over_pinned": ratio(warm.get("loader_Bps"), pinned),
        "overlap_ratio": overlap,
        "overlap_ratio_auto_link": (bench.get("auto_link") or {}).get("overlap_ratio"),
        "streamed_over_resident": bench.get("vs_resident_ratio"),
        "small_card_oom": card.get("oom"),
        "small_card_max_memory_allocated": card.get("max_memory_allocated"),
        "kv_ok": kv.get("ok"),
        "kv_granularities": {
            dtype: {g: e.get("skipped") or e.get("ok") for g, e in (kv.get(dtype) or {}).items()}
            for dtype in ("float32", "bfloat16")
        },
        "attention": {
            dtype: {
                case: (attn.get(dtype) or {}).get(case, {}).get("backend")
                for case in ("start_0", "start_gt_0")
            }
            for dtype in ("bfloat16", "float32")
        },
        "race_reports": sections.get("sanitizer", {}).get("race_reports"),
        "planted_race_caught": sections.get("sanitizer", {}).get("planted_race_caught"),
        "cuda_tests": sections.get("cuda_tests", {}).get("summary"),
        "failed": sorted(k for k, v in sections.items() if v.get("ok") is False),
    }


def emit(report: Json) -> None:
    text = json.dumps(clean(report), indent=2, default=str)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with contextlib.suppress(OSError):
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "gpu-check.json").write_text(text + "\n")
    print(text, flush=True)
