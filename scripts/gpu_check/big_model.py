"""The sections on the big models: writing them (`model`) and a small card (`small_card`)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from .context import Ctx, attempt, say
from .engines import measured_run, plan_json
from .models import tokens, write_random_model
from .sizes import Json

WIDE_WRITE_CAP_S = 45.0  # seconds the wide model's write may take at the big one's rate


def model_section(ctx: Ctx) -> Json:
    """The big random model (written to the work directory) and the plans it gets."""
    import torch
    from tandem.nodes.prefill.planning.budget import default_budget
    from tandem.nodes.prefill.planning.plan import make_plan

    torch.set_num_threads(max(1, (os.cpu_count() or 4) // 4))  # it runs beside other sections
    index, write_s = write_timed(ctx, "big", ctx.sizes.big_model)
    budgets = {
        "default": default_budget(index, torch.device(ctx.device)),
        "small_card": ctx.sizes.card_budget or index.total_bytes // 3,
        "bench": index.total_bytes // 4,
    }
    say(f"model: {index.total_bytes / 1e9:.2f} GB written in {write_s:.1f} s")
    wide = attempt(write_wide, ctx, index.total_bytes / write_s)
    return {
        "wide": wide,
        "shape": ctx.sizes.big_model,
        "dtype": "bfloat16",
        "bytes": index.total_bytes,
        "write_s": write_s,
        "write_Bps": index.total_bytes / write_s,
        "filesystem": filesystem_of(ctx.work),
        "plans": {k: plan_json(make_plan(index, b, direct=True)) for k, b in budgets.items()},
        "plans_note": "weights only (make_plan); the engines' plans, with any activation "
        "reserve, are in the small_card and bench sections",
    }


def write_timed(ctx: Ctx, name: str, shape: Json) -> tuple[Any, float]:
    """A random bf16 model at work/`name` (whole or not at all): (its index, seconds)."""
    from tandem.nodes.model import load_index

    partial = ctx.work / f"{name}.partial"
    t0 = time.perf_counter()
    write_random_model(partial, shape, "bfloat16", ctx.device)
    write_s = time.perf_counter() - t0
    partial.rename(ctx.work / name)
    return load_index(ctx.work / name), write_s


def write_wide(ctx: Ctx, write_Bps: float) -> Json:
    """The memory section's model, unless the disk, as fast as it wrote the big one, would take
    more than WIDE_WRITE_CAP_S (a slow disk must not starve the sections after this one)."""
    from tandem.nodes.model.factory import MakeModelArgs

    a = MakeModelArgs(**ctx.sizes.wide_model)  # type: ignore[arg-type]
    per_layer = 2 * a.hidden * (2 * a.hidden + 2 * a.hidden * a.kv_heads // a.heads)
    approx = a.layers * (per_layer + 6 * a.hidden * a.intermediate) + 4 * a.vocab * a.hidden
    if approx / write_Bps > WIDE_WRITE_CAP_S:
        return {"ok": False, "error": f"skipped: {approx} B at {write_Bps:.0f} B/s would take"
                f" over {WIDE_WRITE_CAP_S:.0f} s"}  # fmt: skip
    index, write_s = write_timed(ctx, "wide", ctx.sizes.wide_model)
    say(f"model: the wide one, {index.total_bytes / 1e9:.2f} GB in {write_s:.1f} s")
    return {"shape": ctx.sizes.wide_model, "bytes": index.total_bytes, "write_s": write_s}


def filesystem_of(path: Path) -> str | None:
    """The filesystem type holding `path` (tmpfs makes the disk rates memory rates)."""
    best, kind = "", None
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


def small_card_section(ctx: Ctx) -> Json:
    """The longest prompt under a small budget, on a card capped to `card_bytes` (CUDA)."""
    import torch
    from tandem.nodes.model import load_index
    from tandem.nodes.prefill.engine import PrefillEngine

    index = load_index(ctx.big)
    budget = ctx.sizes.card_budget or index.total_bytes // 3
    out: Json = {"budget_bytes": budget, "card_bytes": None, "tokens": ctx.sizes.card_tokens}
    if ctx.cuda:
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, ctx.sizes.card_bytes / total))
        out["card_bytes"] = ctx.sizes.card_bytes
    try:
        engine = PrefillEngine(index, budget=budget, device=ctx.device)
    except torch.cuda.OutOfMemoryError as e:
        return {**out, "ok": False, "oom": True, "error": str(e).splitlines()[0]}
    try:
        out["plan"] = plan_json(engine.plan)
        list(engine.prefill(tokens(16, index.spec.vocab_size)))
        out |= measured_run(engine, tokens(ctx.sizes.card_tokens, index.spec.vocab_size), ctx.cuda)
    finally:
        engine.close()
    say(f"small card: oom={out.get('oom')} peak={out.get('max_memory_allocated')}")
    return out
