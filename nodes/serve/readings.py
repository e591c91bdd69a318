"""The node's gauges for `/health` (nodes/contract/gauges.py): the card's counters on a CUDA
prefill node, mlx's memory on a decode node.

`/health` is answered on the event loop and asked often (every peer every 2 s, dashboards,
`/metrics`), while one NVML reading takes 40 ms (two 20 ms PCIe samples). So each source is
`Sampled`: read on its own worker thread, at most once per `REFRESH_S`, and `latest()` hands
back the last reading at once, starting the next read when that one is stale. Nothing polls:
no health check, no read. Each new reading is also published as a `ReadingEvent`. The
readers are imported only for their role, as node.py does
(NVML with the prefill role, mlx with the decode one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from tandem.nodes.contract.events import Event, ReadingEvent
from tandem.nodes.contract.gauges import Gauges

log = logging.getLogger(__name__)

REFRESH_S = 0.5  # a reading is read again when a health check finds it this old


class Sampled:
    """One source of gauges (`read` returns them, or None when there are none here), read
    on a worker thread of its own; `close` runs on that thread too, after the last read."""

    def __init__(
        self,
        read: Callable[[], Gauges | None],
        name: str,
        *,
        close: Callable[[], None] | None = None,
        every_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
        on_reading: Callable[[Gauges], None] | None = None,
    ) -> None:
        self.name = name
        self._read, self._close, self.every_s, self._clock = read, close, every_s, clock
        self._on_reading = on_reading  # each new reading (the node's events), on this thread
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._value: Gauges | None = None
        self._at: float | None = None  # when the last read ended
        self._pending: concurrent.futures.Future[None] | None = None
        self._closed = False

    def latest(self) -> Gauges | None:
        """The last reading (None before the first); a stale one starts the next read."""
        with self._lock:
            stale = self._at is None or self._clock() - self._at >= self.every_s
            if stale and self._pending is None and not self._closed:
                self._pending = self._pool.submit(self._refresh)
            return self._value

    async def prime(self) -> None:
        """Take the first reading now, so the node's first `/health` has it."""
        with self._lock:
            if self._closed:
                return
            if self._pending is None:
                self._pending = self._pool.submit(self._refresh)
            pending = self._pending
        await asyncio.wrap_future(pending)

    def close(self) -> None:
        """Let the reader go once a read in flight ends; `latest()` then reads no more."""
        with self._lock:
            self._closed = True
        if self._close is not None:
            self._pool.submit(self._close)
        self._pool.shutdown(wait=True)

    def _refresh(self) -> None:
        try:
            value = self._read()
        except Exception:  # a gauge is never worth the node: logged, and none shown
            log.exception("%s: reading the gauges failed", self.name)
            value = None
        with self._lock:
            self._value, self._at, self._pending = value, self._clock(), None
        if value is not None and self._on_reading is not None:
            self._on_reading(value)


class NodeReadings:
    """The gauges one node has: `gpu` once a CUDA prefill engine runs, `mlx_memory` once the
    decode role runs; None where the node has none."""

    def __init__(self, publish: Callable[[Event], object] | None = None) -> None:
        self._gpu: Sampled | None = None
        self._mlx: Sampled | None = None
        self._publish = publish  # each new reading as a `ReadingEvent` (`/v1/events`)

    def _announce(self, source: str) -> Callable[[Gauges], None] | None:
        publish = self._publish
        if publish is None:
            return None
        return lambda values: publish(ReadingEvent("", source=source, values=dict(values)))

    def gpu(self) -> Gauges | None:
        return self._gpu.latest() if self._gpu is not None else None

    def mlx_memory(self) -> Gauges | None:
        return self._mlx.latest() if self._mlx is not None else None

    async def watch_gpu(self, device: str) -> None:
        """The card behind a prefill engine's torch `device` (no reading on a CPU)."""
        from tandem.nodes.prefill.measure.nvml import reader_for

        reader = reader_for(device)
        if reader is None:
            return

        def read() -> Gauges | None:
            reading = reader.read()
            return reading.to_json() if reading is not None else None

        self._gpu = Sampled(
            read, "tandem-nvml", close=reader.close, on_reading=self._announce("gpu")
        )
        await self._gpu.prime()

    async def watch_mlx(self) -> None:
        from tandem.nodes.decode.memory import mlx_memory

        self._mlx = Sampled(mlx_memory, "tandem-mlx-memory",
                            on_reading=self._announce("mlx_memory"))  # fmt: skip
        await self._mlx.prime()

    def close(self) -> None:
        for sampled in (self._gpu, self._mlx):
            if sampled is not None:
                sampled.close()
