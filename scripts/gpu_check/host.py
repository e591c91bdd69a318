"""The `host` section (issue 48): what the host side costs a GPU prefill.

- `per_op`: host time per aten op launched (a small add, queued without a sync, median of 3
  runs of 2000): what each kernel of a launch-bound loop costs before the GPU does anything.
- `ram_tier`: the wide model (two layers at 70B's widths) streamed through a ring a third of
  its bytes, its loads all in the pinned RAM tier: the host→device rate through a whole warm
  pass, against the pinned peak the `h2d` section measures.
  With it the process's resident memory (RSS) once an 8k-token request ran beside that pinned
  tier (the handover's buffers, the activations' host side), against the tier's bytes.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .context import Ctx, attempt, say
from .models import tokens
from .sizes import Json

OPS = 2000


def rss_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/status VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def per_op(ctx: Ctx) -> Json:
    import torch

    x = torch.zeros(16, device=ctx.device)
    runs = []
    for _ in range(3):
        if ctx.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(OPS):
            x.add_(1.0)
        runs.append((time.perf_counter() - t0) / OPS)
        if ctx.cuda:
            torch.cuda.synchronize()
    us = statistics.median(runs) * 1e6
    say(f"host: {us:.2f} µs an op")
    return {"us_per_op": us, "ok": True}


def ram_tier(ctx: Ctx) -> Json:
    from tandem.nodes.model import load_index
    from tandem.nodes.model.safetensors_format import ITEMSIZE
    from tandem.nodes.prefill.engine import DEFAULT_CHUNK_TOKENS, PrefillEngine, prompt_activations

    index = load_index(_wide(ctx))
    n = 8192 if ctx.cuda else 128
    reserve = prompt_activations(index.spec, n, 0, DEFAULT_CHUNK_TOKENS, ITEMSIZE[index.dtype],
                                 ctx.device, cut_ops=True)  # fmt: skip
    budget = index.total_bytes // 3 + reserve  # a third of the weights beside the activations
    before = rss_bytes()
    engine = PrefillEngine(index, budget=budget, device=ctx.device, host_budget=index.total_bytes,
                           max_prompt_tokens=n)  # fmt: skip
    try:
        ids = tokens(n, index.spec.vocab_size, seed=8)
        list(engine.prefill(ids[:16]))  # cold: the tier fills from disk
        t0 = time.perf_counter()
        list(engine.prefill(ids[:16]))  # warm: every streamed load from the pinned tier
        wall = time.perf_counter() - t0
        stats: Any = engine.last_stats
        tier = engine.streamer.mover.pinned_bytes
        list(engine.prefill(ids))  # an 8k request beside the pinned tier
        rss = rss_bytes()
    finally:
        engine.close()
    rate = stats.bytes_streamed / stats.h2d_s if stats.h2d_s else None
    say(f"host: RAM tier {stats.ram_bytes} B, h2d {rate and rate / 1e9:.3g} GB/s, RSS "
        f"{rss / 2**30:.2f} GiB with {tier / 2**30:.2f} GiB pinned")  # fmt: skip
    return {
        "ram_bytes": stats.ram_bytes, "disk_bytes": stats.disk_bytes, "wall_s": wall,
        "h2d_s": stats.h2d_s, "h2d_GBps": rate and rate / 1e9, "pinned_bytes": tier,
        "rss_before": before, "rss_after_8k": rss, "tokens": n,
        "ok": stats.disk_bytes == 0 and stats.ram_bytes > 0,
    }  # fmt: skip


def _wide(ctx: Ctx) -> Path:
    path = ctx.work / "wide"
    if not path.is_dir():
        raise RuntimeError("no wide model: the model section did not write it")
    return path


def host_section(ctx: Ctx) -> Json:
    out: Json = {"per_op": attempt(per_op, ctx), "ram_tier": attempt(ram_tier, ctx)}
    out["ok"] = all(v.get("ok") for v in out.values())
    return out
