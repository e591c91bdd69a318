"""The prefill node's queue and its weight passes (issue 46): the requests waiting when a pass
starts join it, up to `max_batch_tokens` (the first always); one that arrives mid-pass waits
for the next. A pass runs on the device thread (`prefix_cache.reusing_pass`: one stream of the
weights, every prompt through each load while it sits in its slot), and each request's layers
go to that request's own queue as they are done, so its frames leave as its layers complete.

A request's reader is its own (`server.py` writes its frames): one that stops reading or goes
away is `dropped` (the pass skips it from its next load on), never waited for; a pass whose
every request was dropped stops (on one device: several ranks run every pass to its end, in
step, `in_step`). Nothing here blocks on a reader.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.cluster import PrefillQueue
from tandem.nodes.contract.events import EventBus, RequestEvent
from tandem.nodes.contract.http import ApiError
from tandem.nodes.prefill.handover import Handed
from tandem.nodes.serve.device import DeviceThread

log = logging.getLogger(__name__)
_END = object()  # a request's last item: its every layer was handed over
# what a pass runs on the device thread: (requests, their dropped flags) -> (place, layer)
# items, returning the positions each computed (`prefix_cache.reusing_pass`, bound)
PassWork = Callable[
    [Sequence[PrefillBody], Sequence[threading.Event]],
    Generator[tuple[int, Handed], None, list[int]],
]
# told of each pass that ran (the node's metrics): its requests, its seconds, the positions
# each computed
PassDone = Callable[[Sequence[PrefillBody], float, list[int]], None]


@dataclass(frozen=True)
class _Failed:
    error: BaseException


@dataclass(eq=False)
class Waiter:
    """One `/v1/prefill` request: queued for a pass, then its layers as the pass makes them."""

    req: PrefillBody
    items: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    dropped: threading.Event = field(default_factory=threading.Event)
    computed: int = 0  # positions computed (not reused), once it is done

    async def next(self) -> Handed | None:
        """Its next layer, None once every layer came; the pass's error, if it failed."""
        item = await self.items.get()
        if item is _END:
            return None
        if isinstance(item, _Failed):
            raise item.error
        return item  # type: ignore[return-value]


class Passes:
    """Requests in, passes run one at a time on the device thread (see the module doc)."""

    def __init__(
        self,
        device: DeviceThread,
        events: EventBus,
        queue_limit: int,
        on_pass: PassDone | None = None,
    ) -> None:
        self.device, self.events, self.queue_limit = device, events, queue_limit
        self.on_pass = on_pass
        self.work: PassWork | None = None  # set once the engine is built
        self.max_batch_tokens = 0  # set with it: 0 takes one request a pass
        # several ranks (`prefill/ranks/`): a pass runs to its end on every rank, read or not
        self.in_step = False
        self._waiting: deque[Waiter] = deque()
        self._running: list[Waiter] = []
        self._runner: asyncio.Task[None] | None = None
        self.passes = 0
        self.pass_sizes: list[int] = []  # requests per pass, the last few (dashboard)
        self.served_tokens = 0
        self.served_s = 0.0
        self.last_reused = 0  # positions the last request took from the prefix cache

    def join(self, req: PrefillBody) -> Waiter:
        """Queue a request for the next pass; 503 when the queue is full."""
        if len(self._waiting) >= self.queue_limit:
            self.events.publish(RequestEvent(req.request_id, phase="failed",
                                             detail="queue full (503)"))  # fmt: skip
            raise ApiError(503, "prefill queue is full", "busy", {"Retry-After": "1"})
        self.events.publish(RequestEvent(req.request_id, phase="queued", tokens=req.count))
        waiter = Waiter(req)
        self._waiting.append(waiter)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return waiter

    def leave(self, waiter: Waiter) -> None:
        """The request's reader is done with it, or gone: the pass skips it from now on."""
        waiter.dropped.set()
        if waiter in self._waiting:
            self._waiting.remove(waiter)

    def queue(self) -> PrefillQueue:
        """What a request that arrives now waits behind (`/health`)."""
        return PrefillQueue(
            waiting=len(self._waiting),
            tokens_waiting=sum(w.req.count for w in self._waiting),
            running_tokens=sum(w.req.count for w in self._running),
            running=len(self._running),
        )

    async def stop(self) -> None:
        """Cancel the pass in flight and wait for it (the node is stopping)."""
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    async def _run(self) -> None:
        while self._waiting:
            batch = self._take()
            if not batch:
                continue
            self._running = batch
            try:
                await self._pass(batch)
            finally:
                self._running = []

    def _take(self) -> list[Waiter]:
        """The waiting requests this pass serves, in arrival order, while their prompts fit
        `max_batch_tokens` (the first always: a prompt the node took fits on its own). A
        prompt counts whole, its prefix too: the pass holds each one's K/V of every position
        in the layer it computes."""
        batch: list[Waiter] = []
        tokens = 0
        while self._waiting:
            w = self._waiting[0]
            if batch and tokens + len(w.req.tokens) > self.max_batch_tokens:
                break
            self._waiting.popleft()
            if not w.dropped.is_set():
                batch.append(w)
                tokens += len(w.req.tokens)
        return batch

    async def _pass(self, batch: list[Waiter]) -> None:
        assert self.work is not None
        reqs, dropped = [w.req for w in batch], [w.dropped for w in batch]
        for w in batch:
            self.events.publish(RequestEvent(w.req.request_id, phase="prefill_start",
                                             tokens=w.req.count, where="remote",
                                             detail=f"pass of {len(batch)}"))  # fmt: skip
        t0 = time.perf_counter()
        counts: list[int] | None = None
        try:
            async with self.device.stream(self.work, reqs, dropped, buffer=2) as items:
                async for i, item in items:
                    if not (self.in_step and dropped[i].is_set()):
                        batch[i].items.put_nowait(item)
                    if all(d.is_set() for d in dropped) and not self.in_step:
                        break  # nobody reads any of it: the device stops after this layer
            counts = items.result
        except Exception as e:  # the pass failed: so did each request in it
            log.exception("prefill pass of %d failed", len(batch))
            for w in batch:
                w.items.put_nowait(_Failed(e))
            return
        self.passes += 1
        self.pass_sizes = [*self.pass_sizes[-63:], len(batch)]
        seconds = time.perf_counter() - t0
        self.served_s += seconds
        for w, n in zip(batch, counts or [0] * len(batch), strict=True):
            w.computed = n
            self.served_tokens += n
            self.last_reused = len(w.req.tokens) - n
            w.items.put_nowait(_END)
        if self.on_pass is not None:
            self.on_pass(reqs, seconds, [w.computed for w in batch])
