"""The sections on the big model: writing it (`model`), peak memory (`memory`), a small card
(`small_card`) and `tandem bench prefill` with the loader's own rates (`bench`)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from .context import Ctx, attempt, say
from .engines import measured_run, plan_json, reserve_of, stream_rates
from .models import tokens, write_random_model
from .sizes import Json


def model_section(ctx: Ctx) -> Json:
    """The big random model (written to the work directory) and the plans it gets."""
    import torch
    from tandem.nodes.model import load_index
    from tandem.nodes.prefill.budget import default_budget
    from tandem.nodes.prefill.plan import make_plan

    torch.set_num_threads(max(1, (os.cpu_count() or 4) // 4))  # it runs beside other sections
    partial = ctx.work / "big.partial"
    t0 = time.perf_counter()
    write_random_model(partial, ctx.sizes.big_model, "bfloat16", ctx.device)
    write_s = time.perf_counter() - t0
    partial.rename(ctx.work / "big")
    index = load_index(ctx.work / "big")
    budgets = {
        "default": default_budget(index, torch.device(ctx.device)),
        "small_card": ctx.sizes.card_budget or index.total_bytes // 3,
        "bench": index.total_bytes // 4,
    }
    say(f"model: {index.total_bytes / 1e9:.2f} GB written in {write_s:.1f} s")
    return {
        "shape": ctx.sizes.big_model,
        "dtype": "bfloat16",
        "bytes": index.total_bytes,
        "write_s": write_s,
        "write_Bps": index.total_bytes / write_s,
        "filesystem": filesystem_of(ctx.work),
        "plans": {k: plan_json(make_plan(index, b, direct=True)) for k, b in budgets.items()},
        "plans_note": "weights only (make_plan); the engines' plans, with any activation "
        "reserve, are in the memory, small_card and bench sections",
    }


def filesystem_of(path: Path) -> str | None:
    """The filesystem type holding `path` (tmpfs makes the disk rates memory rates)."""
    best, kind = "", None
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


def memory_section(ctx: Ctx) -> Json:
    """Peak device memory per prompt length under the default budget."""
    from tandem.nodes.model import load_index
    from tandem.nodes.prefill.engine import PrefillEngine

    index = load_index(ctx.big)
    engine = PrefillEngine(index, device=ctx.device)
    try:
        list(engine.prefill(tokens(16, index.spec.vocab_size)))  # loads the resident set
        runs = {}
        for n in ctx.sizes.memory_tokens:
            ids = tokens(n, index.spec.vocab_size, seed=n)
            run = runs[str(n)] = attempt(measured_run, engine, ids, ctx.cuda)
            peak = run.get("max_memory_allocated", run.get("peak_activation_bytes"))
            say(f"memory {n} tokens: ok={run['ok']} peak={peak} B")
        out = {"budget_bytes": engine.budget, "plan": plan_json(engine.plan), "runs": runs}
    finally:
        engine.close()
    out["ok"] = all(r["ok"] for r in runs.values())
    return out


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


def bench_section(ctx: Ctx) -> Json:
    """`tandem bench prefill` at a quarter of the model, unthrottled and with the link set so
    loading takes as long as compute; then the loader's own rates, warm and cold."""
    import torch
    from tandem.nodes.model import load_index
    from tandem.nodes.model.page_cache import evict_page_cache
    from tandem.nodes.prefill.bench import bench
    from tandem.nodes.prefill.engine import PrefillEngine

    s, model = ctx.sizes, ctx.big
    index = load_index(model)
    # a quarter of the model for weights, plus what the engine keeps back for activations
    budget = index.total_bytes // 4 + reserve_of(index, ctx.device, 512)
    if ctx.cuda:
        torch.cuda.empty_cache()  # after reserve_of's resident engine
    common = {"tokens": s.bench_tokens, "budget": budget, "device": ctx.device, "cold": False}
    # each run on its own: one that fails leaves the others' numbers
    free = attempt(
        lambda: bench(model, link_gbps=None, repeat=s.bench_repeat, vs_resident=True, **common)
    )
    say(f"bench unthrottled: overlap {free.get('overlap_ratio')}, streamed / resident"
        f" {free.get('vs_resident_ratio')}")  # fmt: skip
    if ctx.cuda:
        torch.cuda.empty_cache()  # after the resident engine
    auto = attempt(lambda: bench(model, link_gbps="auto", repeat=1, **common))
    say(f"bench auto link: overlap {auto.get('overlap_ratio')}")

    def loader_rates() -> Json:
        engine = PrefillEngine(index, budget=budget, device=ctx.device)
        loader: Json = {}
        try:
            ids = tokens(64, index.spec.vocab_size)
            list(engine.prefill(ids))  # the resident set, the allocator
            for phase in ("warm", "cold"):
                if phase == "cold":
                    evict_page_cache(index)
                engine.stream_weights()
                loader[phase] = stream_rates(engine)
            loader["plan"] = plan_json(engine.plan)
        finally:
            engine.close()
        return loader

    return {
        "overlap_ratio": free.get("overlap_ratio"),
        "vs_resident_ratio": free.get("vs_resident_ratio"),
        "disk_Bps": free.get("disk_Bps"),
        "copy_Bps": free.get("copy_Bps"),
        "unthrottled": free,
        "auto_link": auto,
        "loader": attempt(loader_rates),
        "ok": all(r.get("ok") is not False for r in (free, auto)),
    }
