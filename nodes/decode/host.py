"""The decode node's model: mlx-lm weights and tokenizer, owned by one device thread.

Everything that touches mlx runs on `ModelHost.thread` (a `DeviceThread`); async code reaches
it with `await host.call(fn, ...)`, and a generation through `host.generation(...)`: an async
iterator of text pieces (a `DeviceStream`) whose mlx work is awaited on every way out, and
whose `result` is the `Generation`. Generation checks its cancel event between tokens, so a
client that disconnects stops its decode within one token.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm, token_loop
from tandem.nodes.decode.families.base import LayerStepper
from tandem.nodes.decode.group.launch import GroupLaunch, Rank0, load_rank0
from tandem.nodes.decode.group.pipeline import GroupError
from tandem.nodes.decode.openai_api import Sampling, TokenLogprob
from tandem.nodes.model.errors import ModelError
from tandem.nodes.serve.device import DeviceStream, DeviceThread

log = logging.getLogger(__name__)
T = TypeVar("T")
# text pieces reach the event loop at most this often (batched): a wake-up per token, a
# syscall on the mlx thread and a turn of the loop, was what the decode did beyond mlx-lm's
TEXT_FLUSH_S = 1 / 30
GROUP_STOP_S = 3.0  # a decode group's other ranks take the stop order within this


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


class ModelHost:
    """mlx-lm model + tokenizer behind a single device thread."""

    def __init__(self, model_dir: str | Path, launch: GroupLaunch | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.thread = DeviceThread("tandem-mlx")
        self.model: Any = None
        self.tokenizer: Any = None
        self.launch = launch  # rank 0 of a decode group `mlx.launch` started
        self.group: Rank0 | None = None

    async def start(self) -> None:
        try:
            if self.launch is not None:
                self.group = await self.call(load_rank0, self.model_dir, self.launch)
                self.model, self.tokenizer = self.group.model, self.group.tokenizer
            else:
                self.model, self.tokenizer = await self.call(lm.load, self.model_dir)
        except GroupError as e:
            raise ModelError(f"{self.model_dir}: {e}") from e
        except Exception as e:  # mlx-lm raises many kinds; the user needs one clear line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"{self.model_dir}: mlx-lm cannot load this model: {first}") from e
        log.info("decode model loaded from %s", self.model_dir)

    def close(self) -> None:
        """Stop the mlx thread (and a group's other ranks: rank 0 orders them to stop; a
        group whose ranks no longer answer cannot be waited for, and the process exits)."""
        if self.group is not None:
            self.group.lost = self.group.lost or "the node is stopping"
            stopped = self.thread.submit(self.group.model.mirror.stop)
            try:
                stopped.result(timeout=GROUP_STOP_S)
            except Exception as e:  # the thread is stuck in a collective, or it failed
                log.error("decode group: the other ranks do not answer (%s); exiting", e)
                logging.shutdown()
                os._exit(1)
        self.thread.close()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.thread.call(fn, *args)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (a base model has none)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_tokens(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the chat-templated prompt (with `tools` where given, as mlx-lm's server
        passes them), ready for the assistant's reply."""
        ids = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=True
        )
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def new_cache(self) -> lm.Caches:
        return lm.new_caches(self.model)

    def measure_prefill(self, count: int) -> float:
        """On the mlx thread: seconds to prefill `count` tokens into a scratch cache."""
        return lm.prefill_seconds(self.model, count)

    def generation(
        self,
        prompt: Sequence[int],
        caches: lm.Caches,
        params: Sampling,
        on_token: Callable[[int], None] | None = None,
        kv_format: KVFormat | None = None,
        first: LayerStepper | None = None,
        on_prompt: Callable[[lm.Caches], None] | None = None,
    ) -> DeviceStream[str]:
        """`async with host.generation(...) as gen: async for text in gen: ...`, then
        `gen.result` (the `Generation`): `texts` on the mlx thread, its pieces as they come.
        `on_prompt` (on the mlx thread) sees the caches once they hold all of the prompt but
        its last token, before the first step."""
        cancel = threading.Event()
        return self.thread.stream(
            self.texts, list(prompt), caches, params, cancel, on_token, kv_format, first,
            on_prompt, cancel=cancel, flush_s=TEXT_FLUSH_S,
        )  # fmt: skip

    def texts(
        self,
        prompt: Sequence[int],
        cache: lm.Caches | None,
        params: Sampling,
        cancel: threading.Event,
        on_token: Callable[[int], None] | None = None,
        kv_format: KVFormat | None = None,
        first: LayerStepper | None = None,
        on_prompt: Callable[[lm.Caches], None] | None = None,
    ) -> Generator[str, None, Generation]:
        """On the mlx thread: decode from `cache` (positions 0..k-1) and `prompt` (k..n-1);
        yields text pieces, returns the `Generation`.

        After a remote prefill `prompt` is just `[t_{n-1}]`, or empty with `first`: that
        token's pass already ran, a layer at a time as the cache filled. Token for token and
        text for text this is mlx-lm's own `stream_generate`, except that the first token is
        handed out as soon as it is sampled (`token_loop.steps`)."""
        if params.seed is not None:
            mx.random.seed(params.seed)
        sample = token_loop.sampler(params.temperature, params.top_p)
        cache = cache if cache is not None else self.new_cache()
        eos = set(self.tokenizer.eos_token_ids)
        text = _Text(self.tokenizer.detokenizer, params.stop)
        out = Generation()
        t0 = time.perf_counter()
        if on_prompt is not None and first is not None:  # the prompt is in already
            on_prompt(cache)
        steps = self._steps(list(prompt), cache, sample, params, kv_format, first, on_prompt)
        for step in steps:
            if cancel.is_set():
                raise Cancelled
            token = step.token
            if params.logprobs:
                out.logprobs.append(self._logprob(step, params.top_logprobs))
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
        self,
        prompt: list[int],
        cache: lm.Caches,
        sampler: token_loop.Sampler,
        params: Sampling,
        kv_format: KVFormat | None = None,
        first: LayerStepper | None = None,
        on_prompt: Callable[[lm.Caches], None] | None = None,
    ) -> Iterator[token_loop.Step]:
        """Tokens as mlx-lm's `generate_step` makes them (`token_loop.steps`), through the logits
        processors the request's penalties and `logit_bias` ask for."""
        logits = first.logits() if first is not None else None
        processors = token_loop.logits_processors(
            params.presence_penalty, params.frequency_penalty, params.logit_bias
        )
        last = first.token if first is not None else (prompt[-1] if prompt else None)
        prompt_seen = on_prompt if first is None else None
        return token_loop.steps(self.model, mx.array(prompt), cache, sampler, params.max_tokens,
                        kv_format, logits, processors, last, prompt_seen)  # fmt: skip

    def _logprob(self, step: token_loop.Step, top: int) -> TokenLogprob:
        decode = self.tokenizer.decode
        alternatives = tuple(
            (decode([t]), lp) for t, lp in token_loop.top_logprobs(step.logprobs, top)
        )
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
