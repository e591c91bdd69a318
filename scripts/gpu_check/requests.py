"""The `requests` section: a second request, and one after an abandoned one, under three budgets."""

from __future__ import annotations

import time
from typing import Any

from .compare import compare, judged
from .context import Ctx, attempt, say
from .engines import engine_at, plan_json, stream_rates, streamed_budget
from .models import small_model, tokens
from .sizes import Json


def requests_case(ctx: Ctx, index: Any, budget: int | None) -> Json:
    """Two requests, then one abandoned after two layers, then a full one: all must agree,
    the second must not reload the resident layers, and nothing may leak."""
    import torch

    ids = tokens(ctx.sizes.kv_tokens, index.spec.vocab_size, seed=2)
    engine = engine_at(index, budget, ctx.device, ctx.sizes.chunk)
    try:
        first = list(engine.prefill(ids))
        first_stats = stream_rates(engine)
        second = list(engine.prefill(ids))
        second_stats = stream_rates(engine)
        if ctx.cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if ctx.cuda else 0
        abandoned = engine.prefill(ids)
        taken = [next(abandoned) for _ in range(2)]
        t0 = time.perf_counter()
        abandoned.close()
        close_s = time.perf_counter() - t0
        after = list(engine.prefill(ids))
        leaked = (torch.cuda.memory_allocated() - before) if ctx.cuda else None
        plan = plan_json(engine.plan)
    finally:
        engine.close()
    # resident layers load once: a second request streams the ring's loads only
    reloaded, streamed = second_stats["bytes_streamed"], first_stats["bytes_streamed"]
    if plan["granularity"] == "resident":
        fewer = reloaded == 0
    else:
        fewer = not plan["resident_layers"] or reloaded < streamed
    entry = {
        "plan": plan,
        "first": first_stats,
        "second": second_stats,
        "second_streams_less": fewer,
        "second_vs_first": judged(compare(first, second), "float32"),
        "cancelled_after_layers": len(taken),
        "cancel_close_s": close_s,
        "after_cancel_vs_first": judged(compare(first, after), "float32"),
        "leaked_bytes": leaked,
    }
    same = entry["second_vs_first"]["ok"] and entry["after_cancel_vs_first"]["ok"]
    entry["ok"] = fewer and same and (leaked is None or leaked < 16 * 2**20)
    say(f"requests {plan['granularity']}: the second streams {reloaded} B of {streamed}")
    return entry


def requests_section(ctx: Ctx) -> Json:
    """A second request on the resident path, and a full one after an abandoned one, under
    the default budget, one that holds the whole model, and a streamed one."""
    import torch
    from tandem.nodes.model import load_index

    torch.backends.cuda.matmul.allow_tf32 = False
    index = load_index(small_model(ctx, "requests", ctx.sizes.kv_model, "float32"))
    budget = streamed_budget(index)
    out = {
        "default_budget": attempt(requests_case, ctx, index, None),
        "resident_budget": attempt(requests_case, ctx, index, index.total_bytes),
        "streamed_budget": attempt(requests_case, ctx, index, budget),
    }
    return {**out, "ok": all(e["ok"] for e in out.values())}
