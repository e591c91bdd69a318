"""`tandem bench group MODEL`: one stream decoded by a group of ranks (run it under
`mlx.launch`; alone it is a group of one): time to first token, tokens per second, each
rank's layers and weight bytes, and the bytes a decode step moves between ranks.

Every rank runs mlx-lm's own `generate_step` over its stage (`pipeline.py`), greedy, so
every rank samples the same tokens; rank 0 reports.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from tandem.nodes.decode.group.pipeline import load_stage


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def bench(
    model_dir: str | Path, prompt_tokens: int, tokens: int, split: Sequence[int] | None = None
) -> dict[str, Any] | None:
    """On every rank of the group `mx.distributed.init()` gives; rank 0's report, None on
    the others."""
    group = mx.distributed.init()
    t0 = time.perf_counter()
    stage, _, shares = load_stage(model_dir, group, split)
    load_s = time.perf_counter() - t0
    prompt = mx.array(bench_prompt(stage.model, prompt_tokens))
    out: list[int] = []
    t0 = time.perf_counter()
    first_s = 0.0
    for token, _ in generate_step(prompt, stage, max_tokens=tokens, sampler=_greedy,
                                  prompt_cache=stage.make_cache()):  # fmt: skip
        out.append(int(token))
        if len(out) == 1:
            first_s = time.perf_counter() - t0
    total_s = time.perf_counter() - t0
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # all done
    if group.rank() != 0:
        return None
    hidden = _hidden_bytes(stage.model)
    size = group.size()
    return {
        "size": size,
        "ranks": [dataclasses.asdict(s) for s in shares],
        "load_s": load_s,
        "prompt_tokens": prompt_tokens,
        "tokens": out,
        "ttft_s": first_s,
        "decode_tok_s": (len(out) - 1) / (total_s - first_s) if len(out) > 1 else 0.0,
        # a step: the hidden state [1, 1, H] from each stage to the next, then the last
        # stage's gathered by every rank
        "step_bytes_sent": (size - 1) * hidden + (size - 1) * size * hidden,
        "hidden_bytes": hidden,
    }


def bench_prompt(model: Any, n: int) -> list[int]:
    """The bench's prompt: `n` token ids spread over the model's vocabulary."""
    vocab = model.model.embed_tokens.weight.shape[0]
    return [(7 * i + 3) % vocab for i in range(n)]


def _hidden_bytes(model: Any) -> int:
    """One token's hidden state, in the model's dtype (bytes)."""
    h = model.model.embed_tokens(mx.array([[0]]))  # [1, 1, H]
    return int(h.shape[-1]) * h.dtype.size
