"""One thread that owns a device backend (mlx on the decode node, the torch device on the
prefill node), reached from the event loop in two ways:

- `await device.call(fn, *args)`: one function on the thread, its result or its error;
- `async with device.stream(fn, *args) as items: async for item in items: ...`: `fn(*args)`
  returns an iterator that runs on the thread; its items cross to the loop as they come, its
  return value is `items.result` at the end, and its error comes out of the `async for`.

A stream's items cross in batches where `flush_s` says so: the thread wakes the loop at most
once per `flush_s` (an item made sooner waits for the next, or for the end), so a stream of
many small items (a decode's text pieces) costs the thread one syscall and the loop one
wake-up per batch, not per item.

A stream is cancelled by its `cancel` event (a `threading.Event`): the thread checks it
between items and stops there. Leaving the `async with` by any way sets it and waits for the
thread to let go (no work runs on after its request, none is left unawaited). Nothing polls:
the thread blocks on a condition (room in a bounded stream, or the cancel), the loop on a
queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_END = object()  # the iterator finished (or failed): its outcome is in the job


EXIT_WAIT_S = 2.0  # how long `close` waits for the ended thread's native exit


class DeviceThread:
    """A single worker thread; `initializer` runs on it first (a thread's priority, say)."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._native_id: int | None = None

        def start() -> None:
            self._native_id = threading.get_native_id()
            if initializer is not None:
                initializer()

        self._pool = concurrent.futures.ThreadPoolExecutor(1, name, initializer=start)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """For code off the event loop: `fn(*args)` on the thread, as a future."""
        return self._pool.submit(fn, *args)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def stream(
        self,
        fn: Callable[..., Iterator[T]],
        *args: Any,
        buffer: int = 0,
        cancel: threading.Event | None = None,
        flush_s: float = 0.0,
    ) -> DeviceStream[T]:
        """`fn(*args)`'s items as an async iterator. With `buffer` > 0 the thread runs at most
        that many items ahead of the reader (back-pressure); 0: it never waits for the reader.
        `cancel`: an event the work itself also checks (inside an item that takes long).
        `flush_s`: the loop is woken at most that often (items batched; not with `buffer`)."""
        return DeviceStream(self, lambda: fn(*args), buffer, cancel, flush_s)

    def close(self) -> None:
        """Finish the work queued, then end the thread, and wait for its native exit.

        A thread's end in Python comes before its native one: the thread-local destructors
        of a library it used run after, and mlx's take the GIL there. Were the interpreter
        finalizing by then (a node stopped just after it started: issue 47), that thread
        would be ended inside the destructor, and the process abort ("terminate called
        without an active exception"). Linux says when the thread is gone
        (/proc/self/task/TID); elsewhere a short wait lets the destructors run."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._native_id is None:
            return
        task = f"/proc/self/task/{self._native_id}"
        if not os.path.isdir("/proc/self/task"):
            time.sleep(0.05)
            return
        deadline = time.monotonic() + EXIT_WAIT_S
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.001)  # (the GIL is free for the destructors meanwhile)


class DeviceStream(Generic[T]):
    """One iterator on a `DeviceThread`, read from the event loop (see the module doc)."""

    def __init__(
        self,
        device: DeviceThread,
        make: Callable[[], Iterator[T]],
        buffer: int,
        cancel: threading.Event | None = None,
        flush_s: float = 0.0,
    ) -> None:
        if buffer and flush_s:  # a held item would wait on room only its reading makes
            raise ValueError("a bounded stream hands each item over at once")
        self._device, self._make, self._buffer = device, make, buffer
        self._flush_s = flush_s
        self._lock = threading.Lock()
        self._pending: list[object] = []  # handed over, not yet on the loop (guarded by _lock)
        self._scheduled = False  # a delivery is queued on the loop (guarded by _lock)
        self._woke = -float("inf")  # time.monotonic() of the last wake-up
        self.cancel = cancel if cancel is not None else threading.Event()
        self.result: Any = None  # the iterator's return value, once it finished
        self._room = threading.Condition()
        self._ahead = 0  # items handed over and not yet read (guarded by _room)
        self._items: asyncio.Queue[object] = asyncio.Queue()
        self._job: asyncio.Future[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop(self) -> None:
        """Cancel from any thread: the device thread stops at its next item."""
        self.cancel.set()
        with self._room:
            self._room.notify_all()

    async def __aenter__(self) -> DeviceStream[T]:
        self._loop = asyncio.get_running_loop()
        self._job = asyncio.wrap_future(self._device.submit(self._pump))
        return self

    def _pump(self) -> Any:
        """On the device thread: run the iterator, handing each item to the loop."""
        try:
            items = self._make()
            try:
                while not self.cancel.is_set():
                    try:
                        item = next(items)
                    except StopIteration as stop:
                        return stop.value
                    if not self._wait_for_room():
                        return None
                    self._hand(item)
                return None
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()
        finally:
            self._hand(_END, at_once=True)

    def _wait_for_room(self) -> bool:
        """False once cancelled; else True when the reader is less than `buffer` behind."""
        with self._room:
            if self._buffer:
                self._room.wait_for(lambda: self._ahead < self._buffer or self.cancel.is_set())
            self._ahead += 1
            return not self.cancel.is_set()

    def _hand(self, item: object, at_once: bool = False) -> None:
        """On the device thread: queue `item` for the loop; wake the loop unless a wake-up is
        already queued or (batching) the last one was less than `flush_s` ago."""
        assert self._loop is not None
        with self._lock:
            self._pending.append(item)
            now = time.monotonic()
            if self._scheduled or (not at_once and now - self._woke < self._flush_s):
                return
            self._scheduled, self._woke = True, now
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        """On the loop: every item handed over so far, in order."""
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for item in items:
            self._items.put_nowait(item)

    def __aiter__(self) -> DeviceStream[T]:
        return self

    async def __anext__(self) -> T:
        item = await self._items.get()
        if item is _END:
            assert self._job is not None
            self.result = await self._job  # raises what the iterator raised
            raise StopAsyncIteration
        if self._buffer:
            with self._room:
                self._ahead -= 1
                self._room.notify()
        return item  # type: ignore[return-value]

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._job is None:
            return
        cancelled = False
        while not self._job.done():  # wait for the device thread even while being cancelled
            try:
                await asyncio.shield(self._job)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:  # its error is the body's to report
                break
        if not self._job.cancelled():
            self._job.exception()  # retrieved: never "exception was never retrieved"
        if cancelled:
            raise asyncio.CancelledError
