"""The `race` section (CUDA only): the copy streams held back on purpose, the K/V unchanged.

`torch.cuda._sleep(cycles)` is enqueued on the mover's copy stream before each load's copies
and on the handover's device→host stream before each layer's copies. Compute that read a slot
before its copy landed, or a host buffer read before its copy finished, would now see stale
bytes; with the events right, the K/V equal an undelayed run's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .compare import FP32_ATOL, compare
from .context import Ctx, say
from .engines import engine_at, streamed_budget
from .models import small_model, tokens
from .sizes import Json

DELAY_CYCLES = 20_000_000  # GPU clock cycles per delay: ~10 ms at 2 GHz


def delayed(stream: Any, fn: Callable[..., Any], cycles: int) -> Callable[..., Any]:
    """`fn`, with `cycles` of sleep enqueued on `stream` before it runs."""
    import torch

    def run(*args: Any, **kw: Any) -> Any:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        return fn(*args, **kw)

    return run


def delay_streams(engine: Any, cycles: int) -> list[str]:
    """Hold back the engine's copy streams (the attributes the CUDA mover and handover keep
    their streams in); the names of the streams delayed."""
    mover = engine.streamer.mover
    handover = engine._handover  # no public hook for this: a check's privilege
    held = []
    if getattr(mover, "_stream", None) is not None:
        mover.fill = delayed(mover._stream, mover.fill, cycles)
        held.append("mover")
    if getattr(handover, "stream", None) is not None:
        handover.kv_done = delayed(handover.stream, handover.kv_done, cycles)
        held.append("handover")
    return held


def race_section(ctx: Ctx) -> Json:
    """A streamed prefill, a second one with both copy streams delayed, and one after a
    prefix with them delayed: each equal to the undelayed run."""
    import torch
    from tandem.nodes.model import load_index

    if not ctx.cuda:
        return {"ok": None, "skipped": "needs CUDA"}
    torch.backends.cuda.matmul.allow_tf32 = False
    index = load_index(small_model(ctx, "race", ctx.sizes.kv_model, "float32"))
    ids = tokens(ctx.sizes.kv_tokens, index.spec.vocab_size, seed=6)
    cut = len(ids) // 3
    budget = streamed_budget(index)
    plain = engine_at(index, budget, ctx.device, ctx.sizes.chunk)
    try:
        reference = list(plain.prefill(ids))
        granularity = plain.plan.granularity
    finally:
        plain.close()
    engine = engine_at(index, budget, ctx.device, ctx.sizes.chunk)
    try:
        held = delay_streams(engine, DELAY_CYCLES)
        got = list(engine.prefill(ids))
        head = [(kv.k, kv.v) for kv in engine.prefill(ids[:cut])]
        tail = list(engine.prefill(ids[cut:], start=cut, prefix=head))
    finally:
        engine.close()
    whole = [type(kv)(kv.layer, kv.k[:, :, cut:], kv.v[:, :, cut:]) for kv in reference]
    out: Json = {"granularity": granularity, "delayed": held, "delay_cycles": DELAY_CYCLES}
    pairs = {"delayed": (reference, got), "delayed_prefix": (whole, tail)}
    for name, (ref, kv) in pairs.items():
        cmp = compare(ref, kv)
        out[name] = {**cmp, "bitwise_equal": cmp.get("max_abs") == 0.0}
        out[name]["ok"] = "error" not in cmp and cmp["max_abs"] <= FP32_ATOL
    say(f"race: delayed {held}: max abs {out['delayed'].get('max_abs')}, "
        f"prefix {out['delayed_prefix'].get('max_abs')}")  # fmt: skip
    agree = out["delayed"]["ok"] and out["delayed_prefix"]["ok"]
    out["ok"] = held == ["mover", "handover"] and agree
    return out
