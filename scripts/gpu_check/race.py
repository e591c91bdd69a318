"""The `race` section (CUDA only): every stream held back on purpose, the K/V and states
unchanged.

`torch.cuda._sleep(cycles)` is enqueued on the mover's copy stream before each load's copies,
on the handover's device→host stream before each layer's K/V and each linear layer's state,
on the prefix upload's stream before each layer's prefix, and on the compute stream before
each load computes (issue 48: the copy streams only, before). Compute that read a slot or a
prefix before its copy landed, or a host buffer read before its copy finished, would now see
stale bytes; with the events right, the handovers equal an undelayed run's. A Llama, its
4-bit form (dequantized into the scratch), a routed Qwen3-MoE (loads of chosen experts) and a
Qwen3.5 (its linear layers' states) each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .compare import FP32_ATOL
from .context import Ctx, attempt, say
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
    """Hold back the engine's streams (the attributes the CUDA mover, handovers and prefix
    uploads keep theirs in: a check's privilege); the names of the streams delayed. The
    handovers and uploads an engine makes from now on are delayed too."""
    import torch
    from tandem.nodes.prefill import engine as engines
    from tandem.nodes.prefill import prefix_upload

    held = []
    mover = engine.streamer.mover
    if getattr(mover, "_stream", None) is not None:
        mover.fill = delayed(mover._stream, mover.fill, cycles)
        held.append("mover")
    if engine.device.type == "cuda":
        made = engines.make_handover

        def make(device: Any) -> Any:
            handover = made(device)
            handover.kv_done = delayed(handover.stream, handover.kv_done, cycles)
            handover.state_done = delayed(handover.stream, handover.state_done, cycles)
            return handover

        engines.make_handover = make
        engine._handovers.clear()  # made again, delayed, at the next pass
        issue = prefix_upload.PrefixUpload._issue

        def late_issue(self: Any, i: int) -> None:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(cycles)
            issue(self, i)

        prefix_upload.PrefixUpload._issue = late_issue  # type: ignore[method-assign]
        compute = engine._compute_load

        def late_compute(*args: Any) -> None:
            torch.cuda._sleep(cycles)  # on the compute stream itself
            compute(*args)

        engine._compute_load = late_compute
        held += ["handover", "state", "prefix", "compute"]
    return held


def _flat(items: list[Any], cut: int = 0) -> list[Any]:
    """Each handover's tensors: K and V (positions from `cut`), or a state's by name."""
    from tandem.nodes.prefill.handover import LayerKV

    out: list[Any] = []
    for item in items:
        if isinstance(item, LayerKV):
            out += [item.k[:, :, cut:], item.v[:, :, cut:]]
        else:
            out += [item.tensors[n] for n in sorted(item.tensors)]
    return out


def _max_abs(a: list[Any], b: list[Any]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return float("inf")
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def race_case(ctx: Ctx, index: Any) -> Json:
    """One model: a streamed prefill, the same with every stream delayed, and one after a
    prefix with them delayed: each equal to the undelayed run."""
    from tandem.nodes.prefill.handover import LayerKV

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
        head = [(x.k, x.v) if isinstance(x, LayerKV) else x.tensors
                for x in engine.prefill(ids[:cut])]  # fmt: skip
        tail = list(engine.prefill(ids[cut:], start=cut, prefix=head))
    finally:
        engine.close()
    out: Json = {"granularity": granularity, "streams_delayed": held, "delay_cycles": DELAY_CYCLES}
    pairs = {"delayed": (_flat(reference), _flat(got)),
             "delayed_prefix": (_flat(reference, cut), _flat(tail))}  # fmt: skip
    for name, (ref, new) in pairs.items():
        worst = _max_abs(ref, new)
        out[name] = {"max_abs": worst, "bitwise_equal": worst == 0.0, "ok": worst <= FP32_ATOL}
    say(f"race {index.spec.family}: delayed {held}: max abs {out['delayed']['max_abs']}, "
        f"prefix {out['delayed_prefix']['max_abs']}")  # fmt: skip
    out["ok"] = len(held) == 5 and out["delayed"]["ok"] and out["delayed_prefix"]["ok"]
    return out


def race_section(ctx: Ctx) -> Json:
    """Every stream delayed, for each model of the module doc."""
    import torch
    from tandem.nodes.model import load_index
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    from .quantized import quantize_model

    if not ctx.cuda:
        return {"ok": None, "skipped": "needs CUDA"}
    torch.backends.cuda.matmul.allow_tf32 = False
    llama = small_model(ctx, "race", ctx.sizes.kv_model, "float32")
    q4 = ctx.work / "race-q4"
    if not q4.is_dir():
        quantize_model(llama, q4)
    made = {"qwen3_moe": {"experts": 32, "top_k": 4, "moe_intermediate": 256},
            "qwen3_5": {}}  # fmt: skip
    for arch, extra in made.items():
        if not (ctx.work / f"race-{arch}").is_dir():
            make_model(ctx.work / f"race-{arch}", MakeModelArgs(
                arch=arch, layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=1024,
                **extra))  # type: ignore[arg-type]  # fmt: skip
    models = {"llama": llama, "llama_4bit": q4, **{a: ctx.work / f"race-{a}" for a in made}}
    out: Json = {name: attempt(race_case, ctx, load_index(path)) for name, path in models.items()}
    out["ok"] = all(v.get("ok") for v in out.values())
    return out
