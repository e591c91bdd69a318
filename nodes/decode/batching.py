"""Every running reply on the mlx thread at once (issue 46): one batch steps them all.

A reply joins (`Batcher.reply`) with its caches, its prompt's rest and its sampling. Each tick
of the scheduler, one job on the node's mlx thread, does one unit of work for every reply:

- a reply still starting runs its own `source` (generate.py) one item on: a prefill chunk,
  or its first token, sampled as the lone loop samples it (time to first token as before);
  once a tick has spent SLICE_S on them, the others start at the next tick;
- once it has its first token, a reply whose caches mlx-lm can merge enters mlx-lm's
  `BatchGenerator` (continuous batching, as its server does: caches per sequence, their own
  sampler, processors and token limit); one `next_generated()` a tick steps every one;
- a reply whose caches cannot merge (quantized KV: mlx-lm 0.32's `QuantizedKVCache` has no
  `merge`) keeps its own token loop and takes one step a tick, between the others': it never
  waits for another reply's end. A decode group's replies batch on every rank alike
  (`group/batch.py`, in the place of `BatchGenerator`).

Between ticks the thread runs its other work (a remote prefill's frames, the prompt cache).
Stop strings, the eos token, limits and log-probabilities are each reply's own (`Reply`); a
reply that ends leaves the batch with its caches (the prompt cache keeps them for the next
turn). Text pieces cross to the event loop at most every `flush_s`, ends at once; a reply
whose reader leaves is dropped at the next tick, and its reader waits for that; a decode
group that is lost (`abandon`) ends every reader at once, without waiting for the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import LayerStepper
from tandem.nodes.decode.generate import Step, check_finite, source
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.openai_api import Sampling
from tandem.nodes.decode.reply import Generation, Reply

log = logging.getLogger(__name__)
# text pieces reach the event loop at most this often: a wake-up per token, a syscall on the
# mlx thread and a turn of the loop, was what the decode did beyond mlx-lm's
TEXT_FLUSH_S = 1 / 30
_END = object()  # a reply's last item: it finished, failed or was dropped
BatchingMode = Literal["continuous", "interleaved"]
# the starting replies' work a tick does before the batch steps: past this, the rest wait a
# step (prompts arriving together get their first tokens one prefill apart, not all at the
# end of every prefill)
SLICE_S = 0.05


class Cancelled(Exception):
    """The reply's reader left before it ended."""


class GroupGone(ConnectionError):
    """The decode group this reply ran on is lost (`Batcher.abandon`)."""


@dataclass(frozen=True)
class Join:
    """What a reply starts from: caches holding positions 0..k-1, the prompt's positions k..n-1
    (just `[t_{n-1}]` after a remote prefill, none with `first`), how to sample."""

    prompt: Sequence[int]
    caches: lm.Caches
    params: Sampling
    on_token: Callable[[int], None] | None = None  # on the mlx thread, with the count so far
    kv_format: KVFormat | None = None
    first: LayerStepper | None = None  # the last prompt token's pass, already run
    on_prompt: Callable[[lm.Caches], None] | None = None  # sees the caches at n-1 positions


class _Member:
    """One reply in the scheduler. Its fields are the mlx thread's, but `cancel` (set by the
    reader) and the loop side (`queue`, `ended`)."""

    def __init__(self, join: Join, loop: asyncio.AbstractEventLoop) -> None:
        self.join, self.loop = join, loop
        self.caches = join.caches  # the caches its reply ends with
        self.reply: Reply | None = None
        self.tokens: Iterator[Step | None] | None = None  # its own loop, until it joins a batch
        self.uid: int | None = None  # in the batch
        self.error: BaseException | None = None
        self.cancel = threading.Event()
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.ended = asyncio.Event()
        self.abandoned: BaseException | None = None  # loop side: ended without the thread

    @property
    def last_prompt_token(self) -> int:
        first = self.join.first
        return first.token if first is not None else self.join.prompt[-1]


class ReplyStream:
    """`async with batcher.reply(join) as r: async for text in r: ...`, then `r.result` (the
    `Generation`) and `r.caches`. Leaving the block by any way drops the reply from the
    scheduler and waits until the mlx thread let go of it."""

    def __init__(self, batcher: Batcher, join: Join) -> None:
        self._batcher, self._join = batcher, join
        self._member: _Member | None = None
        self.result: Generation | None = None
        self.caches: lm.Caches | None = None

    async def __aenter__(self) -> ReplyStream:
        self._member = _Member(self._join, asyncio.get_running_loop())
        with self._batcher._lock:
            self._batcher._readers.add(self._member)
        self._batcher.host.thread.submit(self._batcher._enter, self._member)
        return self

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> str:
        m = self._member
        assert m is not None
        item = await m.queue.get()
        if m.abandoned is not None:
            raise m.abandoned
        if item is not _END:
            return item  # type: ignore[return-value]
        if m.error is not None:
            raise m.error
        assert m.reply is not None
        self.result, self.caches = m.reply.out, m.caches
        raise StopAsyncIteration

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        m = self._member
        if m is None:
            return
        with self._batcher._lock:
            self._batcher._readers.discard(m)
        m.cancel.set()
        if m.abandoned is not None:  # the thread may be held for good: nothing to wait for
            return
        cancelled = False
        while not m.ended.is_set():  # wait for the mlx thread even while being cancelled
            try:
                await asyncio.shield(m.ended.wait())
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError


class Batcher:
    """The scheduler of the node's replies (see the module doc)."""

    def __init__(
        self,
        host: ModelHost,
        flush_s: float = TEXT_FLUSH_S,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self.host, self.flush_s = host, flush_s
        self.on_step = on_step  # each batch step's size, on the mlx thread (the node's metrics)
        self._members: list[_Member] = []
        self._batch: Any = None  # mlx-lm's BatchGenerator, made when a reply first joins one
        self._in_batch: dict[int, _Member] = {}  # by uid
        self._scheduled = False
        self._wired: contextlib.ExitStack | None = None
        self._pending: list[tuple[_Member, object]] = []  # items for the loop, not yet sent
        self._sent = -float("inf")  # time.monotonic() of the last delivery
        self.batch_sizes: list[int] = []  # replies per batch step, the last few (dashboard)
        self._readers: set[_Member] = set()  # every reply being read (loop side), by `_lock`
        self._lock = threading.Lock()

    def reply(self, join: Join) -> ReplyStream:
        return ReplyStream(self, join)

    @property
    def mode(self) -> BatchingMode:
        """Continuous, a decode group's too (its ranks batch alike: `group/batch.py`)."""
        return "continuous"

    @property
    def running(self) -> int:
        return len(self._members)

    def abandon(self, why: str) -> None:
        """From any thread, once a decode group is lost: every reply's reader fails with
        GroupGone(why) at once, not when the mlx thread lets go of it (a collective that a
        killed rank never finishes holds the thread for seconds, a frozen one's for good)."""
        with self._lock:
            readers = list(self._readers)
        for m in readers:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading
                m.loop.call_soon_threadsafe(_abandon, m, GroupGone(why))

    # ------------------------------------------------------------ on the mlx thread

    def _enter(self, m: _Member) -> None:
        j = self.host
        m.reply = Reply(j.tokenizer, m.join.params, m.join.on_token)
        m.tokens = source(j.model, m.join.prompt, m.caches, m.join.params, m.join.kv_format,
                          m.join.first, m.join.on_prompt)  # fmt: skip
        if self._wired is None:  # as `stream_generate`: on a Mac the weights stay wired
            self._wired = contextlib.ExitStack()
            self._wired.enter_context(lm.wired(j.model))
        self._members.append(m)
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self.host.thread.submit(self._tick)
        except RuntimeError as e:  # the thread is shutting down: nothing will run them
            self._scheduled = False
            for m in list(self._members):
                self._end(m, Cancelled(f"the node is stopping ({e})"))
            self._flush(at_once=True)

    def _tick(self) -> None:
        self._scheduled = False
        try:
            for m in [m for m in self._members if m.cancel.is_set()]:
                self._end(m, Cancelled("the reader left"))
            t0 = time.monotonic()
            for m in [m for m in self._members if m.tokens is not None]:
                self._advance(m)
                if time.monotonic() - t0 > SLICE_S:  # a prefill chunk ran: the batch steps,
                    break  # and the next reply's prefill waits one step, not every prefill
            if self._in_batch:
                self._step_batch()
        except Exception as e:  # a fault of the scheduler itself: no reply may hang on it
            log.exception("decode scheduler failed")
            for m in list(self._members):
                self._end(m, e)
        self._flush(at_once=not self._members)
        if self._members:
            self._schedule()
        elif self._wired is not None:
            self._wired.close()
            self._wired = None

    def _advance(self, m: _Member) -> None:
        """One item of a reply's own loop: a prefill chunk or a token; after its first token a
        reply whose caches merge moves into the batch."""
        assert m.tokens is not None and m.reply is not None
        try:
            step = next(m.tokens)
        except StopIteration:
            self._end(m)
            return
        except Exception as e:
            self._end(m, e)
            return
        if step is None:  # a prefill chunk: the others step before the next one
            return
        self._put(m, m.reply.add(step))
        if m.reply.done:
            self._end(m)
        elif self.mode == "continuous" and lm.can_batch(m.caches):
            m.tokens.close()  # nothing of it is queued beyond the token handed out
            m.tokens = None
            self._insert(m, step.token)

    def _insert(self, m: _Member, token: int) -> None:
        """Into the batch: `token` is its next input, the last prompt token starts the
        processors' history (as in the lone loop)."""
        assert m.reply is not None
        p = m.reply.params
        if self._batch is None:  # a decode group's model makes its own (every rank's)
            model = self.host.model
            self._batch = model.new_batch() if hasattr(model, "new_batch") else lm.new_batch(model)
        (m.uid,) = self._batch.insert(
            [[token]],
            max_tokens=[m.reply.left],
            caches=[m.caches],
            all_tokens=[[m.last_prompt_token]],
            samplers=[lm.sampler(p.temperature, p.top_p)],
            logits_processors=[
                lm.logits_processors(p.presence_penalty, p.frequency_penalty, p.logit_bias)
            ],
        )
        self._in_batch[m.uid] = m

    def _step_batch(self) -> None:
        """One step of every reply in the batch."""
        try:
            responses = self._batch.next_generated()
        except Exception as e:  # the batch's state is unknown: every reply in it fails
            for m in list(self._in_batch.values()):
                self._end(m, e)
            self._batch = None
            return
        self.batch_sizes = [*self.batch_sizes[-63:], len(responses)]
        if self.on_step is not None:
            self.on_step(len(responses))
        for r in responses:
            m = self._in_batch.get(r.uid)
            if m is None or m.reply is None:
                continue
            if r.finish_reason is not None:  # the batch let it go: its caches come with it
                del self._in_batch[r.uid]
                m.uid, m.caches = None, r.prompt_cache
            try:
                logprob = check_finite(r.logprobs[r.token].item())
            except ArithmeticError as e:
                self._end(m, e)
                continue
            self._put(m, m.reply.add(Step(r.token, logprob, r.logprobs)))
            if m.reply.done or m.uid is None:
                self._end(m)

    def _end(self, m: _Member, error: BaseException | None = None) -> None:
        """A reply leaves: out of the batch with its caches (or its own loop closed), its
        reader told."""
        if m.uid is not None:
            self._in_batch.pop(m.uid, None)
            left = self._batch.remove([m.uid], return_prompt_caches=error is None)
            if error is None:
                m.caches = left[m.uid][0]
            m.uid = None
        if m.tokens is not None:
            m.tokens.close()
            m.tokens = None
        if m in self._members:
            self._members.remove(m)
        m.error = error
        self._put(m, _END)

    def _put(self, m: _Member, item: object) -> None:
        if item == "":
            return
        self._pending.append((m, item))
        if item is _END:
            self._flush(at_once=True)

    def _flush(self, at_once: bool = False) -> None:
        """Hand the pending items to their loops: at once, or if `flush_s` has passed."""
        now = time.monotonic()
        if not self._pending or (not at_once and now - self._sent < self.flush_s):
            return
        items, self._pending, self._sent = self._pending, [], now
        for loop in {m.loop for m, _ in items}:
            mine = [(m, item) for m, item in items if m.loop is loop]
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading
                loop.call_soon_threadsafe(_deliver, mine)


def _abandon(m: _Member, error: BaseException) -> None:
    """On the loop: the reader's next item raises `error`."""
    if m.abandoned is None and not m.ended.is_set():
        m.abandoned = error
        m.queue.put_nowait(_END)


def _deliver(items: list[tuple[_Member, object]]) -> None:
    """On the loop: each item to its reply's reader, in order."""
    for m, item in items:
        m.queue.put_nowait(item)
        if item is _END:
            m.ended.set()
