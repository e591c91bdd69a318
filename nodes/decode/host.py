"""The decode node's model: mlx-lm weights and tokenizer, owned by one thread.

Everything that touches mlx runs on `ModelHost.thread` (a single-worker executor); async code
reaches it with `await host.call(fn, ...)`, and a generation through `host.generation(...)`:
an async iterator of text pieces whose mlx work is awaited on every way out. Generation checks
a cancel flag between tokens, so a client that disconnects stops its decode within one token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import make_sampler
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import kv
from tandem.nodes.decode.first_step import FirstStep
from tandem.nodes.decode.openai_api import Sampling
from tandem.nodes.model.errors import ModelError

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFILL_STEP = 2048  # mlx-lm's prefill_step_size: same chunks, same numbers


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

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.thread = concurrent.futures.ThreadPoolExecutor(1, "tandem-mlx")
        self.model: Any = None
        self.tokenizer: Any = None

    async def start(self) -> None:
        try:
            self.model, self.tokenizer = await self.call(mlx_load, str(self.model_dir))
        except Exception as e:  # mlx-lm raises many kinds; the user needs one clear line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"{self.model_dir}: mlx-lm cannot load this model: {first}") from e
        log.info("decode model loaded from %s", self.model_dir)

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of the chat-templated prompt, ready for the assistant's reply."""
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def new_cache(self) -> kv.Caches:
        return kv.new_caches(self.model)

    def first_step(self, token: int, caches: kv.Caches) -> FirstStep | None:
        """The last prompt token's pass, to run a layer at a time as `caches` fill (None
        where the model's structure is not one `FirstStep` knows)."""
        return FirstStep.for_model(self.model, token, caches)

    def generation(
        self,
        prompt: Sequence[int],
        caches: kv.Caches,
        params: Sampling,
        on_token: Callable[[int], None] | None = None,
        kv_format: KVFormat | None = None,
        first: FirstStep | None = None,
    ) -> GenerationStream:
        """`async with host.generation(...) as gen: async for text in gen: ...`, then
        `gen.result`: `generate` on the mlx thread, its text pieces as they come."""
        return GenerationStream(self, prompt, caches, params, on_token, kv_format, first)

    def measure_prefill(self, count: int) -> float:
        """On the mlx thread: seconds to prefill `count` tokens into a scratch cache."""
        vocab = self.model.args.vocab_size if hasattr(self.model, "args") else 256
        tokens = mx.array([[(7 * i + 3) % vocab for i in range(count)]])
        self.model(tokens[:, :8], cache=self.new_cache())  # warm-up: first call allocates
        mx.eval(self.model.parameters())
        cache = self.new_cache()
        t0 = time.perf_counter()
        out = self.model(tokens, cache=cache)
        mx.eval(out)
        kv.evaluate(cache)
        return max(time.perf_counter() - t0, 1e-9)

    def generate(
        self,
        prompt: Sequence[int],
        cache: list[Any] | None,
        params: Sampling,
        cancel: threading.Event,
        on_text: Callable[[str], None] | None = None,
        on_token: Callable[[int], None] | None = None,
        kv_format: KVFormat | None = None,
        first: FirstStep | None = None,
    ) -> Generation:
        """On the mlx thread: decode from `cache` (positions 0..k-1) and `prompt` (k..n-1).

        After a remote prefill `prompt` is just `[t_{n-1}]`, or empty with `first`: that
        token's pass already ran, a layer at a time as the cache filled. Token for token and
        text for text this is mlx-lm's own `stream_generate`, except that the first token is
        handed out as soon as it is sampled: mlx-lm's pipelined loop computes token 2 before it
        yields token 1, which on a CPU stream puts a whole decode step into time to first
        token.
        """
        if params.seed is not None:
            mx.random.seed(params.seed)
        sampler = make_sampler(temp=params.temperature, top_p=params.top_p)
        cache = cache if cache is not None else self.new_cache()
        eos = set(self.tokenizer.eos_token_ids)
        detokenizer = self.tokenizer.detokenizer
        out = Generation()
        t0 = time.perf_counter()
        pending = ""  # text held back while it could still be the start of a stop string
        hold = max((len(s) for s in params.stop), default=0)
        tokens = self._tokens(
            mx.array(list(prompt)), cache, sampler, params.max_tokens, kv_format, first
        )
        for token in tokens:
            if cancel.is_set():
                raise Cancelled
            out.token_at.append(time.perf_counter())
            if out.tokens == 0:
                out.first_token_s = out.token_at[0] - t0
            out.tokens += 1
            out.token_ids.append(token)
            if on_token is not None:
                on_token(out.tokens)
            if token in eos:
                out.finish_reason = "stop"
                break
            detokenizer.add_token(token)
            pending += detokenizer.last_segment
            if (stop_at := _find_stop(pending, params.stop)) is not None:
                self._emit(out, pending[:stop_at], on_text)
                out.finish_reason = "stop"
                return self._done(out, t0)
            if out.tokens == params.max_tokens:
                break
            ready = len(pending) - (hold - 1 if hold else 0)
            if ready > 0:
                self._emit(out, pending[:ready], on_text)
                pending = pending[ready:]
        detokenizer.finalize()  # an eos or the token limit: flush what the detokenizer holds
        pending += detokenizer.last_segment
        if (stop_at := _find_stop(pending, params.stop)) is not None:
            pending, out.finish_reason = pending[:stop_at], "stop"
        self._emit(out, pending, on_text)
        return self._done(out, t0)

    @staticmethod
    def _done(out: Generation, t0: float) -> Generation:
        out.decode_s = time.perf_counter() - t0 - out.first_token_s
        return out

    def _tokens(
        self,
        prompt: mx.array,
        cache: list[Any],
        sampler: Callable[..., mx.array],
        max_tokens: int,
        kv_format: KVFormat | None = None,
        first: FirstStep | None = None,
    ) -> Iterator[int]:
        """mlx-lm's `generate_step`, op for op: the prompt in 2048-token steps, then one token
        per step, each step queued (`async_eval`) before the previous token is handed out.

        The one change: the first token is handed out as soon as it is sampled. mlx-lm queues
        token 2 first, and where `async_eval` does the work on the spot (mlx's CPU backend)
        that puts a whole decode step into time to first token."""

        def sample(logits: mx.array) -> mx.array:
            kv.quantize_when_due(cache, kv_format)  # after the call, as mlx-lm does
            return sampler(logits - mx.logsumexp(logits, keepdims=True))

        def step(tokens: mx.array) -> mx.array:
            return sample(self.model(tokens[None], cache=cache)[:, -1, :])

        with mx.stream(generation_stream):
            if first is not None:  # the last prompt token's pass ran as the cache filled
                y = sample(first.logits())
            else:
                while prompt.size > 1:
                    n = min(PREFILL_STEP, prompt.size - 1)
                    self.model(prompt[:n][None], cache=cache)
                    kv.quantize_when_due(cache, kv_format)
                    kv.evaluate(cache)
                    prompt = prompt[n:]
                    mx.clear_cache()
                y = step(prompt)
        yield int(y.item())
        if max_tokens < 2:
            return
        with mx.stream(generation_stream):
            y = step(y)
        mx.async_eval(y)
        for n in range(2, max_tokens + 1):
            following = None
            if n < max_tokens:  # the next step computes while this token is handed out
                with mx.stream(generation_stream):
                    following = step(y)
                mx.async_eval(following)
            yield int(y.item())
            if following is None:
                return
            if n % 256 == 0:
                mx.clear_cache()
            y = following

    @staticmethod
    def _emit(out: Generation, text: str, on_text: Callable[[str], None] | None) -> None:
        if text:
            out.text += text
            if on_text is not None:
                on_text(text)


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None


_END = object()  # the generation finished (or failed): its result is in the job


class GenerationStream:
    """One generation on the mlx thread as an async iterator of its text pieces.

    Leaving the `async with` block by any way (the end, an error, a cancelled request) sets
    the cancel flag and waits for the mlx thread to let go of the caches: no generation runs
    on after its request, and none is left unawaited."""

    def __init__(
        self,
        host: ModelHost,
        prompt: Sequence[int],
        caches: kv.Caches,
        params: Sampling,
        on_token: Callable[[int], None] | None,
        kv_format: KVFormat | None = None,
        first: FirstStep | None = None,
    ) -> None:
        self._host = host
        self._args = (list(prompt), caches, params)
        self._on_token = on_token
        self._kv_format = kv_format
        self._first = first
        self.cancel = threading.Event()
        self._texts: asyncio.Queue[object] = asyncio.Queue()
        self._job: asyncio.Future[Generation] | None = None
        self.result: Generation | None = None

    async def __aenter__(self) -> GenerationStream:
        loop = asyncio.get_running_loop()

        def put(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading
                loop.call_soon_threadsafe(self._texts.put_nowait, item)

        def run() -> Generation:
            try:
                prompt, caches, params = self._args
                return self._host.generate(
                    prompt,
                    caches,
                    params,
                    self.cancel,
                    put,
                    self._on_token,
                    self._kv_format,
                    self._first,
                )
            finally:
                put(_END)

        self._job = loop.run_in_executor(self._host.thread, run)
        return self

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> str:
        item = await self._texts.get()
        if item is _END:
            assert self._job is not None
            self.result = await self._job  # raises what the generation raised
            raise StopAsyncIteration
        assert isinstance(item, str)
        return item

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel.set()
        if self._job is None:
            return
        cancelled = False
        while not self._job.done():  # wait for the mlx thread even while being cancelled
            try:
                await asyncio.shield(self._job)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:  # its error is the body's to report, below
                break
        if not self._job.cancelled():
            self._job.exception()  # retrieved: never "exception was never retrieved"
        if cancelled:
            raise asyncio.CancelledError
