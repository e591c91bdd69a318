"""mlx-lm's token loop, seen from tandem (`lm.py` holds the caches and the prompt loop): its
`generate_step` op for op, its samplers and logits processors, and the log-probabilities a
reply may ask for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import wired_limit
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode.lm import STREAM, Caches, prefill, quantize_when_due

Sampler = Callable[[mx.array], mx.array]  # log-probabilities [1, vocab] -> token [1]
Processor = Callable[[mx.array, mx.array], mx.array]  # (history [n], logits [1, vocab])


def sampler(temperature: float, top_p: float) -> Sampler:
    return make_sampler(temp=temperature, top_p=top_p)


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


def logits_processors(
    presence: float, frequency: float, bias: Sequence[tuple[int, float]]
) -> list[Processor]:
    """mlx-lm's logits processors for OpenAI's penalties and `logit_bias` (none for zeros),
    each over the last 20 tokens as mlx-lm's server has them."""
    return make_logits_processors(
        dict(bias) or None, presence_penalty=presence or None, frequency_penalty=frequency or None
    )


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
    on_prompt: Callable[[Caches], None] | None = None,
) -> Iterator[Step]:
    """mlx-lm's `generate_step`, op for op: the prompt in PREFILL_STEP-token steps, then one
    token per step, each step queued (`async_eval`) before the previous token is handed out.

    The one change: the first token is handed out as soon as it is sampled. mlx-lm queues
    token 2 first, and where `async_eval` does the work on the spot (mlx's CPU backend) that
    puts a whole decode step into time to first token. With `first_logits` ([1, vocab]: the
    last prompt token's pass already ran) `prompt` is not read, and `last_token` is that
    token (the processors' history starts with it, as mlx-lm's does). `on_prompt` sees the
    caches once they hold the prompt but its last token. NonFinite when the
    sampled token's log-probability is NaN or infinite (so are the logits then)."""
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

    # as `stream_generate` does: on a Mac the weights stay wired in memory while it runs
    with wired_limit(model, [STREAM]):
        if first_logits is not None:
            with mx.stream(STREAM):
                quantize_when_due(caches, kv_format)
                current = sampled(logprobs(first_logits, mx.array([last_token or 0])))
        else:
            last = prefill(model, prompt, caches, kv_format)
            if on_prompt is not None:
                on_prompt(caches)
            current = step(last)
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
    logprob = own.item()
    if not math.isfinite(logprob):
        raise NonFinite(
            "the model produced non-finite values (NaN or infinite logits): are its weights "
            "corrupt or mismatched? (tandem node --verify-weights checks them)"
        )
    return Step(int(y.item()), logprob, lp[0])


def top_logprobs(logprobs: mx.array, n: int) -> list[tuple[int, float]]:
    """The `n` likeliest tokens of a step's log-probabilities [vocab], likeliest first."""
    if n <= 0:
        return []
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
    values = logprobs[ids]
    pairs = zip(ids.tolist(), values.tolist(), strict=True)
    return sorted(pairs, key=lambda p: -p[1])
