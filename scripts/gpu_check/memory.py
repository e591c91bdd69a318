"""The `memory` section: a few layers at 70B's widths at 512, 2k and 8k tokens, the device's
measured peak against what the plan reserves for activations (`engine.activation_reserve`)."""

from __future__ import annotations

from typing import Any

from .context import Ctx, attempt, say
from .engines import measured_run, plan_json
from .models import tokens
from .report import ratio
from .sizes import Json


def reserve_run(engine: Any, n: int, cuda: bool) -> Json:
    """One prompt of `n` tokens: the peak above what was allocated before it (weights, ring,
    scratch), over the reserve; on a CPU the plan's own count stands in (no allocator peak)."""
    import torch

    ids = tokens(n, engine.spec.vocab_size, seed=n)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    run = measured_run(engine, ids, cuda)
    if cuda and "max_memory_allocated" in run:
        run["activation_bytes"] = run["max_memory_allocated"] - before
    measured = run.get("activation_bytes", run.get("peak_activation_bytes"))
    run["reserve_bytes"] = engine.activation_reserve
    run["measured_over_reserve"] = ratio(measured, engine.activation_reserve)
    run["measured_over_predicted"] = ratio(measured, run.get("peak_activation_bytes"))
    within = run["measured_over_reserve"] is not None and run["measured_over_reserve"] <= 1.0
    run["ok"] = bool(run["ok"]) and within
    return run


def memory_section(ctx: Ctx) -> Json:
    """The wide model resident under the default budget, reserving for the longest prompt
    measured; each prompt's activation peak must stay within that reserve."""
    from tandem.nodes.model import load_index
    from tandem.nodes.prefill.engine import PrefillEngine

    path = ctx.work / "wide"
    if not path.is_dir():
        raise RuntimeError("no wide model: the model section did not write it")
    index = load_index(path)
    longest = max(ctx.sizes.memory_tokens)
    engine = PrefillEngine(index, device=ctx.device, max_prompt_tokens=longest)
    try:
        list(engine.prefill(tokens(16, index.spec.vocab_size)))  # loads the resident set
        runs = {}
        for n in ctx.sizes.memory_tokens:
            run = runs[str(n)] = attempt(reserve_run, engine, n, ctx.cuda)
            say(f"memory {n} tokens: ok={run['ok']} measured / reserve "
                f"{run.get('measured_over_reserve')}")  # fmt: skip
        out = {
            "model": ctx.sizes.wide_model,
            "budget_bytes": engine.budget,
            "reserve_bytes": engine.activation_reserve,
            "max_prompt_tokens": longest,
            "plan": plan_json(engine.plan),
            "measured": "max_memory_allocated above the allocation before the prompt"
            if ctx.cuda
            else "the plan's count (no allocator peak on a CPU)",
            "runs": runs,
        }
    finally:
        engine.close()
    out["ok"] = all(r["ok"] for r in runs.values())
    return out
