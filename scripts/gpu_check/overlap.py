"""The `bench` section: `tandem bench prefill` at a quarter of the big model, unthrottled and
with loading made as long as compute; then the loader's own rates from the RAM tier (warm) and
from the disk (cold, capped)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .context import Ctx, attempt, say
from .engines import plan_json, reserve_of, stream_rates
from .models import tokens
from .sizes import GiB, Json

COLD_CAP_BYTES = 2 * GiB  # the most a cold pass reads from disk: a slow disk costs ~seconds
BALANCE_SLACK = 1.15  # compute made this much longer than unthrottled loading; the link then
# throttles loading down to it


def balanced_tokens(free: Json, n: int, chunk: int, longest: int) -> int:
    """A prompt long enough that compute takes at least as long as unthrottled loading (the
    link throttle can slow loading, not speed it): `n` scaled by load / compute, whole chunks,
    at most `longest`."""
    load, compute = free.get("load_s"), free.get("compute_s")
    if not load or not compute or compute >= load:
        return n
    return min(longest, math.ceil(n * load / compute * BALANCE_SLACK / chunk) * chunk)


def bench_section(ctx: Ctx) -> Json:
    """Unthrottled (with the all-resident engine beside it), then balanced: a prompt at which
    compute outlasts loading and the link set (`link_gbps="auto"`, from the measured compute
    time) so that loading takes as long as compute; the overlap is judged on that one."""
    import torch
    from tandem.nodes.contract.http import DEFAULT_CHUNK_TOKENS
    from tandem.nodes.model import load_index
    from tandem.nodes.prefill.measure.bench import bench
    from tandem.nodes.prefill.planning.budget import longest_prompt

    s, model = ctx.sizes, ctx.big
    index = load_index(model)
    # a quarter of the model for weights, plus what the engine keeps back for activations
    budget = index.total_bytes // 4 + reserve_of(index, ctx.device, 512)
    if ctx.cuda:
        torch.cuda.empty_cache()  # after reserve_of's resident engine
    common = {"budget": budget, "device": ctx.device, "cold": False, "host_budget": "auto"}
    # each run on its own: one that fails leaves the others' numbers
    free = attempt(lambda: bench(model, s.bench_tokens, link_gbps=None, repeat=s.bench_repeat,
                                 vs_resident=True, **common))  # fmt: skip
    say(f"bench unthrottled: overlap {free.get('overlap_ratio')}, streamed / resident"
        f" {free.get('vs_resident_ratio')}")  # fmt: skip
    if ctx.cuda:
        torch.cuda.empty_cache()  # after the resident engine
    longest = longest_prompt(index.spec, ctx.device) or 4 * s.bench_tokens
    n = balanced_tokens(free, s.bench_tokens, DEFAULT_CHUNK_TOKENS, longest)
    balanced = attempt(lambda: bench(model, n, link_gbps="auto", repeat=s.bench_repeat, **common))
    load, compute = balanced.get("load_s"), balanced.get("compute_s")
    balanced["load_over_compute"] = load / compute if load and compute else None
    say(f"bench balanced at {n} tokens: overlap {balanced.get('overlap_ratio')}, load / compute"
        f" {balanced['load_over_compute']}")  # fmt: skip
    return {
        "overlap_ratio": balanced.get("overlap_ratio"),
        "load_over_compute": balanced["load_over_compute"],
        "unthrottled_overlap_ratio": free.get("overlap_ratio"),
        "vs_resident_ratio": free.get("vs_resident_ratio"),
        "disk_Bps": free.get("disk_Bps"),
        "copy_Bps": free.get("copy_Bps"),
        "unthrottled": free,
        "balanced": balanced,
        "loader": attempt(loader_rates, ctx, model, budget),
        "ok": all(r.get("ok") is not False for r in (free, balanced)),
    }


def loader_rates(ctx: Ctx, model: Path, budget: int) -> Json:
    """Every streamed load once, nothing computed: from the RAM tier (a warm pass after the
    pass that fills it), then from the disk with the page cache evicted and no RAM tier, at a
    budget that leaves at most COLD_CAP_BYTES to read."""
    from tandem.nodes.model import load_index
    from tandem.nodes.prefill.engine import PrefillEngine

    index = load_index(model)
    out: Json = {}
    engine = PrefillEngine(index, budget=budget, device=ctx.device, host_budget="auto")
    try:
        list(engine.prefill(tokens(64, index.spec.vocab_size)))  # resident set, allocator, tier
        engine.stream_weights()  # whatever the tier still lacks, read once
        engine.stream_weights()
        out["ram"] = stream_rates(engine)
        out["ram"]["ram_tier_bytes"] = engine.plan.host_bytes
        out["plan"] = plan_json(engine.plan)
    finally:
        engine.close()
    reserve = reserve_of(index, ctx.device, 512)
    cold_budget = max(budget, index.total_bytes - COLD_CAP_BYTES + reserve)
    out["cold"] = attempt(cold_pass, ctx, index, cold_budget)
    return out


def cold_pass(ctx: Ctx, index: Any, budget: int) -> Json:
    """One pass of every streamed load from the disk, the page cache evicted first."""
    from tandem.nodes.model.page_cache import evict_page_cache
    from tandem.nodes.prefill.engine import PrefillEngine

    engine = PrefillEngine(index, budget=budget, device=ctx.device, host_budget=0)
    try:
        list(engine.prefill(tokens(16, index.spec.vocab_size)))
        evict_page_cache(index)
        engine.stream_weights()
        return {**stream_rates(engine), "budget_bytes": budget, "cap_bytes": COLD_CAP_BYTES}
    finally:
        engine.close()
