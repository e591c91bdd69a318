"""`tandem bench prefill --batch N`: N prompts in one weight pass against N lone passes, on one
engine, in turns (one pass of N, then the N alone, `repeat` times) so that a slow spell of a
shared machine weighs on both (issue 46; FlexGen: one pass, many sequences).

`batch_wall_s` (median) against `lone_wall_s` (the N lone passes' summed wall, median);
`batch_ratio`, the median of each turn's batch / lone (where the link binds, ≈ 1/N plus the
compute the N prompts add; unthrottled, never above 1); `batch_bytes` and `lone_bytes`, the
weight bytes each streamed (one pass's, against N passes').
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
from tandem.nodes.prefill.batch import Ask
from tandem.nodes.prefill.engine import PrefillEngine


def vs_lone(
    engine: PrefillEngine, n: int, tokens: int, repeat: int, before: Callable[[], None]
) -> dict[str, float]:
    """N fresh prompts of `tokens` each, one pass against N lone passes, in turns."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, engine.spec.vocab_size, tokens).tolist() for _ in range(n)]
    turns = []
    for _ in range(repeat):
        before()
        for _ in engine.prefill_pass([Ask(p) for p in prompts]):
            pass
        batch = engine.last_stats
        lone_wall, lone_bytes = 0.0, 0
        for p in prompts:
            before()
            for _ in engine.prefill(p):
                pass
            lone_wall += engine.last_stats.wall_s
            lone_bytes += engine.last_stats.bytes_streamed
        turns.append((batch.wall_s, batch.bytes_streamed, lone_wall, lone_bytes))
    return {
        "batch": n,
        "batch_wall_s": statistics.median(t[0] for t in turns),
        "lone_wall_s": statistics.median(t[2] for t in turns),
        "batch_ratio": statistics.median(t[0] / t[2] for t in turns),
        "batch_bytes": turns[-1][1],
        "lone_bytes": turns[-1][3],
    }
