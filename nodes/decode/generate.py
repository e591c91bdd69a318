"""The tokens of one reply on the mlx thread: mlx-lm's token loop (`generate_step` op for op,
its samplers and logits processors), reached through `lm.py` (the caches, the prompt loop, the
samplers). `source` is what a reply starts from: its prompt's rest in mlx-lm's prefill chunks
(a `None` after each, so the replies already running step between them), then its tokens.
`reply.py` makes a reply's text of them; `batching.py` runs every reply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import LayerStepper
from tandem.nodes.decode.lm import (
    STREAM,
    Caches,
    Processor,
    Sampler,
    logits_processors,
    quantize_when_due,
    sampler,
)
from tandem.nodes.decode.openai_api import Sampling


def source(
    model: Any,
    prompt: Sequence[int],
    caches: Caches,
    params: Sampling,
    kv_format: KVFormat | None = None,
    first: LayerStepper | None = None,
    on_prompt: Callable[[Caches], None] | None = None,
) -> Iterator[Step | None]:
    """A reply's tokens from `caches` (positions 0..k-1) and `prompt` (k..n-1): `None` after
    each prefill chunk, then each `Step`. After a remote prefill `prompt` is `[t_{n-1}]`, or
    empty with `first` (that token's pass already ran, a layer at a time as the cache filled).
    `on_prompt` sees the caches once they hold all of the prompt but its last token."""
    if params.seed is not None:
        mx.random.seed(params.seed)
    rest = list(prompt)
    if first is None:
        for left in lm.prefill_chunks(model, rest, caches, kv_format):
            rest = left
            if len(rest) > 1:
                yield None
    if on_prompt is not None:
        on_prompt(caches)
    processors = logits_processors(
        params.presence_penalty, params.frequency_penalty, params.logit_bias
    )
    last = first.token if first is not None else rest[-1]
    logits = first.logits() if first is not None else None
    sample = sampler(params.temperature, params.top_p)
    yield from steps(model, mx.array(rest if first is None else []), caches, sample,
                     params.max_tokens, kv_format, logits, processors, last)  # fmt: skip


class NonFinite(ArithmeticError):
    """The model's logits held NaN or infinite values: its weights are corrupt, or not the
    ones its config describes."""


@dataclass(frozen=True)
class Step:
    """One generated token and the log-probabilities [vocab] it was sampled from (after the
    logits processors), lazily evaluated."""

    token: int
    logprob: float  # of `token`
    logprobs: mx.array


def steps(
    model: Any,
    prompt: mx.array,
    caches: Caches,
    sample: Sampler,
    max_tokens: int,
    kv_format: KVFormat | None = None,
    first_logits: mx.array | None = None,
    processors: Sequence[Processor] = (),
    last_token: int | None = None,
) -> Iterator[Step]:
    """mlx-lm's `generate_step`, op for op: the prompt in PREFILL_STEP-token steps, then one
    token per step, each step queued (`async_eval`) before the previous token is handed out.

    The one change: the first token is handed out as soon as it is sampled. mlx-lm queues
    token 2 first, and where `async_eval` does the work on the spot (mlx's CPU backend) that
    puts a whole decode step into time to first token. With `first_logits` ([1, vocab]: the
    last prompt token's pass already ran) `prompt` is not read, and `last_token` is that
    token (the processors' history starts with it, as mlx-lm's does). NonFinite when the
    sampled token's log-probability is NaN or infinite (so are the logits then). The weights
    stay wired (on a Mac) while whoever runs the steps says (`batching.py`)."""
    history: mx.array | None = None

    def logprobs(logits: mx.array, inputs: mx.array) -> mx.array:
        nonlocal history
        if processors:  # as generate_step: the step's input tokens join the history
            history = inputs if history is None else mx.concatenate([history, inputs])
            for processor in processors:
                logits = processor(history, logits)
        return logits - mx.logsumexp(logits, keepdims=True)

    def sampled(lp: mx.array) -> _Sampled:
        y = sample(lp)  # [1]
        return y, lp, mx.take_along_axis(lp, y[:, None], axis=-1)  # the token's own [1, 1]

    def step(tokens: mx.array) -> _Sampled:
        with mx.stream(STREAM):
            logits = model(tokens[None], cache=caches)[:, -1, :]
            quantize_when_due(caches, kv_format)  # after the call, as mlx-lm does
            return sampled(logprobs(logits, tokens))

    if first_logits is not None:
        with mx.stream(STREAM):
            quantize_when_due(caches, kv_format)
            current = sampled(logprobs(first_logits, mx.array([last_token or 0])))
    else:
        current = step(lm.prefill(model, prompt, caches, kv_format))
    yield from _pipelined(current, step, max_tokens)


def _pipelined(
    current: _Sampled, step: Callable[[mx.array], _Sampled], max_tokens: int
) -> Iterator[Step]:
    """The first token as soon as it is sampled; then each step queued before the previous
    token is handed out (mlx-lm's lookahead of one)."""
    yield _step(current)
    if max_tokens < 2:
        return
    current = step(current[0])
    mx.async_eval(*current)
    for n in range(2, max_tokens + 1):
        following = None
        if n < max_tokens:  # the next step computes while this token is handed out
            following = step(current[0])
            mx.async_eval(*following)
        yield _step(current)
        if following is None:
            return
        if n % 256 == 0:
            mx.clear_cache()
        current = following


_Sampled = tuple[mx.array, mx.array, mx.array]  # token [1], logprobs [1, vocab], its own [1, 1]


def _step(current: _Sampled) -> Step:
    """The step's token, once its graph ran (the token's log-probability came with it)."""
    y, lp, own = current
    return Step(int(y.item()), check_finite(own.item()), lp[0])


def check_finite(logprob: float) -> float:
    """A sampled token's log-probability, or NonFinite where it is NaN or infinite (so are the
    logits then)."""
    if not math.isfinite(logprob):
        raise NonFinite(
            "the model produced non-finite values (NaN or infinite logits): are its weights "
            "corrupt or mismatched? (tandem node --verify-weights checks them)"
        )
    return logprob


def top_logprobs(logprobs: mx.array, n: int) -> list[tuple[int, float]]:
    """The `n` likeliest tokens of a step's log-probabilities [vocab], likeliest first."""
    if n <= 0:
        return []
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
    values = logprobs[ids]
    pairs = zip(ids.tolist(), values.tolist(), strict=True)
    return sorted(pairs, key=lambda p: -p[1])
