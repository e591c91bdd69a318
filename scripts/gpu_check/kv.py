"""The `kv` section: the device's K/V against the CPU's at each granularity and after a prefix."""

from __future__ import annotations

from typing import Any

from .compare import BF16_REL, FP32_ATOL, compare, judged
from .context import Ctx, attempt, say
from .engines import GRANULARITIES, engine_at, plan_budgets
from .models import small_model, tokens
from .sizes import Json


def kv_case(
    ctx: Ctx,
    index: Any,
    dtype: str,
    want: str,
    budget: int,
    ids: list[int],
    reference: list[Any] | None,
) -> Json:
    """One granularity: the device's K/V against `reference` (None: the CPU's at the same
    budget), and a prefill split at a prefix against its own one-shot prefill."""
    cut = len(ids) * 2 // 5  # not on a chunk boundary
    test = engine_at(index, budget, ctx.device, ctx.sizes.chunk)
    ref = None if reference is not None else engine_at(index, budget, "cpu", ctx.sizes.chunk)
    try:
        if ref is not None:
            reference = list(ref.prefill(ids))
        assert reference is not None
        got = list(test.prefill(ids))
        head = [(kv.k, kv.v) for kv in test.prefill(ids[:cut])]
        tail = list(test.prefill(ids[cut:], start=cut, prefix=head))
        one_shot = [type(kv)(kv.layer, kv.k[:, :, cut:], kv.v[:, :, cut:]) for kv in got]
        entry = {
            "budget_bytes": budget,
            "granularity": test.plan.granularity,
            "reference_granularity": ref.plan.granularity if ref else "resident",
            "n_slots": test.plan.n_slots,
            "resident_layers": len(test.plan.resident_layers),
            "vs_reference": judged(compare(reference, got), dtype),
            "prefix": {"start": cut, **judged(compare(one_shot, tail), dtype)},
        }
    finally:
        test.close()
        if ref is not None:
            ref.close()
    ok = entry["vs_reference"]["ok"] and entry["prefix"]["ok"]
    entry["ok"] = ok and entry["granularity"] == want
    say(f"kv {dtype} {want}: max abs {entry['vs_reference'].get('max_abs')}, "
        f"prefix {entry['prefix'].get('max_abs')}")  # fmt: skip
    return entry


def kv_section(ctx: Ctx) -> Json:
    """The device's K/V against the CPU's, at each granularity and after a prefix.

    CUDA: CUDA vs CPU at the same budget. CPU smoke: CPU at each budget vs CPU all-resident,
    which still checks that every granularity computes the same thing."""
    import torch
    from tandem.nodes.model import load_index

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out: Json = {}
    for dtype in ("float32", "bfloat16"):
        index = load_index(small_model(ctx, "kv", ctx.sizes.kv_model, dtype))
        ids = tokens(ctx.sizes.kv_tokens, index.spec.vocab_size, seed=1)
        reference = None
        if not ctx.cuda:
            engine = engine_at(index, index.total_bytes, "cpu", ctx.sizes.chunk)
            reference = list(engine.prefill(ids))
            engine.close()
        budgets = plan_budgets(index)
        out[dtype] = {
            want: attempt(kv_case, ctx, index, dtype, want, budgets[want], ids, reference)
            if want in budgets  # the planner may have no such plan for this model
            else {"ok": None, "skipped": f"no budget gives a {want} plan"}
            for want in GRANULARITIES
        }
    entries = [e for d in ("float32", "bfloat16") for e in out[d].values()]
    out["ok"] = all(e["ok"] is not False for e in entries) and any(e["ok"] for e in entries)
    out["bounds"] = {"float32_max_abs": FP32_ATOL, "bfloat16_max_rel": BF16_REL}
    out["devices"] = f"{ctx.device} vs cpu"
    return out
