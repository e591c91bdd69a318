"""Engines at the budgets the planner turns into each granularity, and what a run measures."""

from __future__ import annotations

from typing import Any

from .sizes import Json

GRANULARITIES = ("resident", "layer", "part", "slice")


def plan_json(plan: Any) -> Json:
    return {
        "granularity": plan.granularity,
        "n_slots": plan.n_slots,
        "slot_bytes": plan.slot_bytes,
        "resident_layers": list(plan.resident_layers),
        "device_bytes": plan.device_bytes,
        "budget_bytes": plan.budget_bytes,
        "reserve_bytes": getattr(plan, "reserve_bytes", None),
    }


def plan_budgets(index: Any) -> dict[str, int]:
    """The largest budget whose plan has each granularity (weights only), found by stepping
    down from the whole model."""
    from tandem.nodes.model.errors import ModelError
    from tandem.nodes.prefill.planning.plan import make_plan

    found: dict[str, int] = {}
    budget = index.total_bytes
    while len(found) < len(GRANULARITIES):
        try:
            granularity = make_plan(index, budget, direct=True).granularity
        except ModelError:
            break
        found.setdefault(granularity, budget)
        budget = int(budget * 0.9)
    return found


def streamed_budget(index: Any) -> int:
    """The budget of the coarsest streamed plan the planner makes for this model."""
    budgets = plan_budgets(index)
    return budgets[next(g for g in GRANULARITIES[1:] if g in budgets)]


_RESERVES: dict[tuple[int, str, int], int] = {}


def reserve_of(index: Any, device: str, chunk: int) -> int:
    """What the engine keeps back from its budget for activations (on CUDA), read off an
    all-resident engine (the budget is not allocated, only the plan)."""
    from tandem.nodes.prefill.engine import PrefillEngine

    key = (id(index), device, chunk)
    if key not in _RESERVES:
        big = index.total_bytes + 2**40
        engine = PrefillEngine(index, budget=big, device=device, chunk_tokens=chunk)
        _RESERVES[key] = getattr(engine, "activation_reserve", 0) or 0
        engine.close()
    return _RESERVES[key]


def engine_at(index: Any, weights: int | None, device: str, chunk: int) -> Any:
    """An engine with `weights` bytes for weights (plan_budgets' budgets) plus its activation
    reserve; None: the engine's default budget."""
    from tandem.nodes.prefill.engine import PrefillEngine

    budget = None if weights is None else weights + reserve_of(index, device, chunk)
    return PrefillEngine(index, budget=budget, device=device, chunk_tokens=chunk)


def stream_rates(engine: Any) -> Json:
    """The last request's loader numbers: bytes, seconds, and copy and disk rates."""
    st, ss = engine.last_stats, engine.streamer.last_stats
    disk_s = getattr(st, "disk_s", 0.0) or ss.disk_s
    h2d_s = getattr(st, "h2d_s", 0.0) or ss.h2d_s
    return {
        "wall_s": st.wall_s,
        "bytes_streamed": st.bytes_streamed,
        "disk_bytes": st.disk_bytes,
        "ram_bytes": st.ram_bytes,
        "disk_s": disk_s,
        "h2d_s": h2d_s,
        "loader_Bps": st.bytes_streamed / st.wall_s if st.wall_s else None,
        "copy_Bps": st.bytes_streamed / h2d_s if h2d_s else None,
        "disk_Bps": st.disk_bytes / disk_s if disk_s else None,
    }


def measured_run(engine: Any, ids: list[int], cuda: bool) -> Json:
    """One request: its wall time and memory, or the OOM or refusal it met."""
    import torch
    from tandem.nodes.prefill.errors import PrefillError

    try:
        layers = sum(1 for _ in engine.prefill(ids))
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"ok": False, "oom": True, "error": str(e).splitlines()[0]}
    except PrefillError as e:  # e.g. a prompt refused before streaming: not an OOM
        return {"ok": False, "oom": False, "refused": str(e)}
    st = engine.last_stats
    run: Json = {
        "ok": layers == engine.spec.num_layers,
        "oom": False,
        "tokens": len(ids),
        "wall_s": st.wall_s,
        "tokens_per_s": len(ids) / st.wall_s if st.wall_s else None,
        "peak_activation_bytes": st.peak_activation_bytes,
        "bytes_streamed": st.bytes_streamed,
    }
    if cuda:
        run["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        run["memory_allocated"] = torch.cuda.memory_allocated()
    return run
