"""The report: issues 17's and 34's numbers picked out of the sections, as strict JSON on
stdout and in $OUT/gpu-check.json."""

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
    """The numbers issues 17 and 34 ask for, picked out of the sections (their bounds are
    judged on CUDA only: the smoke run's numbers are too small to mean anything)."""
    h2d, bench = sections.get("h2d", {}), sections.get("bench", {})
    pinned = (h2d.get("pinned") or {}).get("best_Bps")
    ram = (bench.get("loader") or {}).get("ram") or {}
    card, memory = sections.get("small_card", {}), sections.get("memory", {})
    kv, attn = sections.get("kv", {}), sections.get("attention", {})
    ram_ratio, overlap = ratio(ram.get("loader_Bps"), pinned), bench.get("overlap_ratio")
    reserve = [r.get("measured_over_reserve") for r in (memory.get("runs") or {}).values()]
    worst = max(reserve) if reserve and None not in reserve else None
    targets = {  # issue 17's and 34's bounds; None where the number is missing
        "RAM tier loader / pinned peak >= 0.9": None if ram_ratio is None else ram_ratio >= 0.9,
        "overlap_ratio (load ~ compute) <= 1.10": None if overlap is None else overlap <= 1.10,
        "70B-wide peak / reserve <= 1 at 512, 2k, 8k": None if worst is None else worst <= 1.0,
        "no OOM at 8k tokens, 6 GiB budget": None if card.get("oom") is None else not card["oom"],
    }
    return {
        "targets": "not judged in a smoke run" if smoke else targets,
        "pinned_h2d_Bps": pinned,
        "ram_loader_Bps": ram.get("loader_Bps"),
        "ram_loader_over_pinned": ram_ratio,
        "ram_copy_over_pinned": ratio(ram.get("copy_Bps"), pinned),
        "ram_pass_disk_bytes": ram.get("disk_bytes"),
        "overlap_ratio": overlap,
        "load_over_compute": bench.get("load_over_compute"),
        "overlap_ratio_unthrottled": bench.get("unthrottled_overlap_ratio"),
        "streamed_over_resident": bench.get("vs_resident_ratio"),
        "memory_over_reserve": {
            k: r.get("measured_over_reserve") for k, r in (memory.get("runs") or {}).items()
        },
        "small_card_oom": card.get("oom"),
        "small_card_max_memory_allocated": card.get("max_memory_allocated"),
        "kv_ok": kv.get("ok"),
        "kv_granularities": {
            dtype: {g: e.get("skipped") or e.get("ok") for g, e in (kv.get(dtype) or {}).items()}
            for dtype in ("float32", "bfloat16")
        },
        "quantized_ok": sections.get("quantized", {}).get("ok"),
        "race_ok": sections.get("race", {}).get("ok"),
        "ranks_ok": sections.get("ranks", {}).get("ok"),
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
