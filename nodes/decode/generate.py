"""One generation on the mlx thread: mlx-lm's token loop (`generate_step` op for op, its
samplers and logits processors), the text it makes (stop strings, log-probabilities), and
the `Generation` it returns. It reaches mlx-lm only through `lm.py` (the caches, the prompt
loop, the samplers).

`generation` runs `texts` on the host's mlx thread as a `DeviceStream`: text pieces as they
come, then the `Generation`. It checks its cancel event between tokens, so a client that
disconnects stops its decode within one token.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import LayerStepper
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.lm import (
    STREAM,
    Caches,
    Processor,
    Sampler,
    logits_processors,
    prefill,
    quantize_when_due,
    sampler,
    wired,
)
from tandem.nodes.decode.openai_api import Sampling, TokenLogprob
from tandem.nodes.serve.device import DeviceStream


@dataclass
class Generation:
    """What one decode produced; `text` excludes any stop string."""

    text: str = ""
    tokens: int = 0
    finish_reason: str = "length"
    first_token_s: float = 0.0  # from the call to the first token (includes local prefill)
    decode_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    token_at: list[float] = field(default_factory=list)  # perf_counter() of each token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # where the request asks

    @property
    def first_token_at(self) -> float | None:
        """time.perf_counter() when the first token was sampled."""
        return self.token_at[0] if self.token_at else None

    @property
    def steady_tok_s(self) -> float | None:
        """Decode rate once the pipeline runs: tokens after the second over the time from the
        second to the last (the first interval fills the one-step lookahead)."""
        if len(self.token_at) < 3 or self.token_at[-1] <= self.token_at[1]:
            return None
        return (len(self.token_at) - 2) / (self.token_at[-1] - self.token_at[1])


class Cancelled(Exception):
    """The request was cancelled while decoding."""


# text pieces reach the event loop at most this often (batched): a wake-up per token, a
# syscall on the mlx thread and a turn of the loop, was what the decode did beyond mlx-lm's
TEXT_FLUSH_S = 1 / 30


def generation(
    host: ModelHost,
    prompt: Sequence[int],
    caches: Caches,
    params: Sampling,
    on_token: Callable[[int], None] | None = None,
    kv_format: KVFormat | None = None,
    first: LayerStepper | None = None,
    on_prompt: Callable[[Caches], None] | None = None,
) -> DeviceStream[str]:
    """`async with generation(host, ...) as gen: async for text in gen: ...`, then
    `gen.result` (the `Generation`): `texts` on the host's mlx thread, its pieces as they
    come, its mlx work awaited on every way out. `on_prompt` (on the mlx thread) sees the
    caches once they hold all of the prompt but its last token, before the first step."""
    cancel = threading.Event()
    return host.thread.stream(
        texts, host.model, host.tokenizer, list(prompt), caches, params, cancel, on_token,
        kv_format, first, on_prompt, cancel=cancel, flush_s=TEXT_FLUSH_S,
    )  # fmt: skip


def texts(
    model: Any,
    tokenizer: Any,
    prompt: Sequence[int],
    cache: Caches | None,
    params: Sampling,
    cancel: threading.Event,
    on_token: Callable[[int], None] | None = None,
    kv_format: KVFormat | None = None,
    first: LayerStepper | None = None,
    on_prompt: Callable[[Caches], None] | None = None,
) -> Generator[str, None, Generation]:
    """On the mlx thread: decode from `cache` (positions 0..k-1) and `prompt` (k..n-1);
    yields text pieces, returns the `Generation`.

    After a remote prefill `prompt` is just `[t_{n-1}]`, or empty with `first`: that
    token's pass already ran, a layer at a time as the cache filled. Token for token and
    text for text this is mlx-lm's own `stream_generate`, except that the first token is
    handed out as soon as it is sampled (`steps`)."""
    if params.seed is not None:
        mx.random.seed(params.seed)
    sample = sampler(params.temperature, params.top_p)
    cache = cache if cache is not None else lm.new_caches(model)
    eos = set(tokenizer.eos_token_ids)
    text = _Text(tokenizer.detokenizer, params.stop)
    out = Generation()
    t0 = time.perf_counter()
    if on_prompt is not None and first is not None:  # the prompt is in already
        on_prompt(cache)
    for step in _steps(model, list(prompt), cache, sample, params, kv_format, first, on_prompt):
        if cancel.is_set():
            raise Cancelled
        token = step.token
        if params.logprobs:
            out.logprobs.append(_logprob(tokenizer, step, params.top_logprobs))
        out.token_at.append(time.perf_counter())
        out.tokens += 1
        out.token_ids.append(token)
        if on_token is not None:
            on_token(out.tokens)
        if token in eos:
            out.finish_reason = "stop"
            break
        piece, stopped = text.add(token, last=out.tokens == params.max_tokens)
        if piece:
            out.text += piece
            yield piece
        if stopped:
            out.finish_reason = "stop"
            return _done(out, t0)
        if out.tokens == params.max_tokens:
            break
    piece, stopped = text.finish()  # an eos or the token limit: flush what is held
    out.finish_reason = "stop" if stopped else out.finish_reason
    if piece:
        out.text += piece
        yield piece
    return _done(out, t0)


def _steps(
    model: Any,
    prompt: list[int],
    cache: Caches,
    sample: Sampler,
    params: Sampling,
    kv_format: KVFormat | None = None,
    first: LayerStepper | None = None,
    on_prompt: Callable[[Caches], None] | None = None,
) -> Iterator[Step]:
    """Tokens as mlx-lm's `generate_step` makes them (`steps`), through the logits
    processors the request's penalties and `logit_bias` ask for."""
    logits = first.logits() if first is not None else None
    processors = logits_processors(
        params.presence_penalty, params.frequency_penalty, params.logit_bias
    )
    last = first.token if first is not None else (prompt[-1] if prompt else None)
    prompt_seen = on_prompt if first is None else None
    return steps(model, mx.array(prompt), cache, sample, params.max_tokens, kv_format, logits,
                 processors, last, prompt_seen)  # fmt: skip


def _logprob(tokenizer: Any, step: Step, top: int) -> TokenLogprob:
    decode = tokenizer.decode
    alternatives = tuple((decode([t]), lp) for t, lp in top_logprobs(step.logprobs, top))
    return TokenLogprob(decode([step.token]), step.logprob, alternatives)


def _done(out: Generation, t0: float) -> Generation:
    out.first_token_s = out.token_at[0] - t0 if out.token_at else 0.0
    out.decode_s = time.perf_counter() - t0 - out.first_token_s
    return out


class _Text:
    """The detokenizer's text, held back while it could still be the start of a stop
    string; cut at the first stop string."""

    def __init__(self, detokenizer: Any, stops: Sequence[str]) -> None:
        self.detokenizer, self.stops = detokenizer, [s for s in stops if s]
        self.pending = ""
        self.hold = max((len(s) for s in self.stops), default=0)

    def add(self, token: int, last: bool) -> tuple[str, bool]:
        """(text ready to hand out, whether a stop string ended it) after `token`. The last
        token's text stays held for `finish`."""
        self.detokenizer.add_token(token)
        self.pending += self.detokenizer.last_segment
        if (stop_at := self._find_stop()) is not None:
            ready, self.pending = self.pending[:stop_at], ""
            return ready, True
        if last:
            return "", False
        ready = len(self.pending) - (self.hold - 1 if self.hold else 0)
        if ready <= 0:
            return "", False
        out, self.pending = self.pending[:ready], self.pending[ready:]
        return out, False

    def finish(self) -> tuple[str, bool]:
        self.detokenizer.finalize()
        self.pending += self.detokenizer.last_segment
        if (stop_at := self._find_stop()) is not None:
            return self.pending[:stop_at], True
        return self.pending, False

    def _find_stop(self) -> int | None:
        if not self.stops:
            return None
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        return min(hits) if hits else None


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
    with wired(model):
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
