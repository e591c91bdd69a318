"""The sanitizer's children: streamed requests under `TORCH_CUDA_SANITIZER=1`, and a race
planted on purpose that it must report."""

from __future__ import annotations

import threading

from .compare import compare, judged
from .context import Ctx
from .engines import engine_at, streamed_budget
from .models import small_model, tokens
from .sizes import Json


def sanitize_new_threads() -> bool:
    """CSAN's dispatch mode is thread-local: enter it in every thread started from now on, so
    the loader's copies are tracked beside compute. False where the sanitizer is off."""
    from torch.cuda import _sanitizer

    sanitizer = getattr(_sanitizer, "cuda_sanitizer", None)
    if not getattr(sanitizer, "enabled", False):
        return False
    mode, run = sanitizer.dispatch, threading.Thread.run  # type: ignore[union-attr]

    def sanitized_run(self: threading.Thread) -> None:
        with mode:
            run(self)

    threading.Thread.run = sanitized_run  # type: ignore[method-assign]
    return True


def sanitized_section(ctx: Ctx) -> Json:
    """Streamed requests (full, repeated, abandoned, after a prefix) for the sanitizer's eyes;
    the parent reads the race reports from stderr."""
    from tandem.nodes.model import load_index

    tracked = sanitize_new_threads()
    s = ctx.sizes
    shape = {**s.kv_model, "layers": 4}
    index = load_index(small_model(ctx, "sanitized", shape, "bfloat16"))
    ids = tokens(256 if ctx.cuda else s.kv_tokens, index.spec.vocab_size, seed=3)
    cut = len(ids) // 3
    engine = engine_at(index, streamed_budget(index), ctx.device, s.chunk)
    try:
        first = list(engine.prefill(ids))
        list(engine.prefill(ids))
        abandoned = engine.prefill(ids)
        next(abandoned)
        abandoned.close()
        again = list(engine.prefill(ids))
        prefix = [(kv.k, kv.v) for kv in engine.prefill(ids[:cut])]
        list(engine.prefill(ids[cut:], start=cut, prefix=prefix))
        granularity = engine.plan.granularity
    finally:
        engine.close()
    return {
        "threads_tracked": tracked,
        "granularity": granularity,
        "requests": 5,
        "repeat_vs_first": judged(compare(first, again), "bfloat16"),
    }


def planted_section(ctx: Ctx) -> Json:
    """A race planted on purpose, from another thread as the loader's copies come: the
    sanitizer must report it, or its silence over the real requests proves nothing."""
    if not ctx.cuda:
        return {"skipped": "no cuda"}
    import torch

    tracked = sanitize_new_threads()
    x = torch.zeros(1 << 20, device="cuda")  # written on the default stream
    side = torch.cuda.Stream()

    def write() -> None:
        with torch.cuda.stream(side):
            x.add_(1.0)  # and on a side stream that never waited for it: a race

    writer = threading.Thread(target=write, name="planted-race")
    writer.start()
    writer.join()
    torch.cuda.synchronize()
    return {"threads_tracked": tracked}
