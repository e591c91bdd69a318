"""The decode node's side of `/v1/prefill`: ask a prefill node for K/V and fill mlx caches
layer by layer as frames arrive, while the prefill node computes the next layer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nodes.auth import auth_headers
from nodes.decode import http_stream
from nodes.decode.host import ModelHost
from nodes.decode.http_stream import HttpError
from nodes.decode.kv import CacheBuilder
from nodes.events import EventBus, LayerEvent, LinkEvent
from nodes.kv_link import arrival_seconds
from nodes.wire import (
    PREFIX,
    PROTO,
    Done,
    ErrorFrame,
    Frame,
    FrameReader,
    Header,
    LayerKV,
    Span,
)

log = logging.getLogger(__name__)


class RemotePrefillError(Exception):
    """The prefill node could not deliver: unreachable, refused, garbage, or died mid-stream.

    `retry_after` (seconds) is set when the node said it is busy (503 + Retry-After)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class RemoteResult:
    node: str  # the prefill node's address
    tokens: int  # positions computed remotely
    kv_bytes: int  # response body bytes
    seconds: float  # request to last frame
    transfer_s: float  # layer frames' bytes at the rate they arrived (`arrival_seconds`)

    @property
    def prefill_tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens else None

    @property
    def link_Bps(self) -> float | None:
        return self.kv_bytes / self.transfer_s if self.transfer_s > 0 else None


class BufferPool:
    """Buffers that layer frames are read into, reused: the pages of a buffer read into
    again are already mapped, where a fresh one takes a page fault per 4 KiB as bytes land.
    Used from the event loop only."""

    def __init__(self, keep_bytes: int = 256 * 2**20) -> None:
        self.keep_bytes = keep_bytes  # idle buffers kept, in bytes at most
        self._free: list[bytearray] = []

    def take(self, n: int) -> bytearray:
        """A buffer of n bytes or a little more (its contents are stale)."""
        for i, buffer in enumerate(self._free):
            if n <= len(buffer) <= 2 * n:
                return self._free.pop(i)
        return bytearray(n)

    def give(self, span: Span) -> None:
        """The buffers `span` was read into are free again (nothing else refers to them)."""
        for part in span.parts:
            buffer = part.obj if isinstance(part, memoryview) else part
            kept = sum(len(b) for b in self._free)
            if isinstance(buffer, bytearray) and kept + len(buffer) <= self.keep_bytes:
                self._free.append(buffer)


async def remote_prefill(
    url: str,
    token: str | None,
    *,
    fingerprint: str,
    request_id: str,
    tokens: list[int],
    start: int,
    host: ModelHost,
    caches: list[Any],
    events: EventBus,
    timeout_s: float = 300.0,
    buffers: BufferPool | None = None,
) -> RemoteResult:
    """Fill `caches` (holding positions 0..start-1) with positions start..len(tokens)-1."""
    body = {
        "proto": PROTO,
        "fingerprint": fingerprint,
        "request_id": request_id,
        "tokens": tokens,
        "start": start,
    }
    t0 = time.perf_counter()
    buffers = buffers or BufferPool()
    reader = FrameReader(alloc=buffers.take)
    assembler = _Assembler(host, caches, events, request_id, start, buffers)
    total = 0
    transfer_s = 0.0
    try:
        async with (
            asyncio.timeout(timeout_s),
            http_stream.post(
                f"{url}/v1/prefill",
                json.dumps(body).encode(),
                auth_headers(token),
                read_timeout_s=min(60.0, timeout_s),
            ) as resp,
        ):
            if resp.status != 200:
                detail = (await resp.read(300)).decode(errors="replace")
                retry = _retry_after(resp.headers) if resp.status == 503 else None
                raise RemotePrefillError(f"{url} answered {resp.status}: {detail}", retry)
            # a frame's receive time: its reads from the first to the last, at the rate of the
            # bytes after the first (a read never runs past its frame: the reader gives the buffer)
            first: tuple[float, int] | None = None  # at the frame's first read: time, bytes in
            while n := await resp.read_into(reader.get_buffer()):
                arrived = time.perf_counter()
                first = first or (arrived, resp.conn.received)
                total += n
                for frame in reader.buffer_updated(n):
                    if isinstance(frame, LayerKV):
                        size = PREFIX.size + len(frame.payload)
                        seconds = arrival_seconds(
                            size, arrived - first[0], resp.conn.received - first[1]
                        )
                        transfer_s += seconds
                        link = LinkEvent(request_id, name="net_in", bytes=size, seconds=seconds)
                        events.publish(link)
                    first = None
                    await assembler.take(frame)
                    await asyncio.sleep(0)  # reads that never wait would starve the loop
            reader.finish()
            await assembler.finish()
    except (HttpError, TimeoutError, OSError) as e:
        raise RemotePrefillError(f"{url}: {type(e).__name__}: {e}") from e
    except Exception as e:  # ProtocolError and friends: the stream is unusable
        if isinstance(e, RemotePrefillError):
            raise
        raise RemotePrefillError(f"{url}: {type(e).__name__}: {e}") from e
    finally:
        await assembler.close()
    return RemoteResult(url, len(tokens) - start, total, time.perf_counter() - t0, transfer_s)


class _Assembler:
    """Applies layer frames to the caches on the mlx thread while the network keeps reading:
    layer i goes into its cache as layer i+1 arrives (a few frames of slack, then
    back-pressure on the connection)."""

    def __init__(
        self,
        host: ModelHost,
        caches: list[Any],
        events: EventBus,
        request_id: str,
        start: int,
        buffers: BufferPool,
    ) -> None:
        self.host, self.caches, self.events, self.buffers = host, caches, events, buffers
        self.request_id, self.start = request_id, start
        self.queue: asyncio.Queue[LayerKV | None] = asyncio.Queue(maxsize=4)
        self.task: asyncio.Task[None] | None = None
        self.builder: CacheBuilder | None = None

    async def take(self, frame: Frame) -> None:
        if isinstance(frame, ErrorFrame):
            raise RemotePrefillError(f"prefill node error {frame.code}: {frame.message}")
        if isinstance(frame, Header):
            if frame.start != self.start:
                raise RemotePrefillError(
                    f"asked for positions from {self.start}, got {frame.start}"
                )
            self.builder = CacheBuilder(frame, self.caches)
            self.task = asyncio.create_task(self._apply_all(), name="kv-assembly")
        elif isinstance(frame, LayerKV):
            assert self.task is not None  # the reader guarantees a header first
            if self.task.done():
                await self.task  # it failed: raise its error here
            await self.queue.put(frame)
        elif isinstance(frame, Done):
            log.debug("request %s: %d layers received", self.request_id, frame.layers)

    async def _apply_all(self) -> None:
        assert self.builder is not None
        while (frame := await self.queue.get()) is not None:
            await self.host.call(self.builder.add, frame)
            self.buffers.give(frame.payload)  # copied into the cache: the buffer is free
            received = LayerEvent(
                self.request_id, layer=frame.layer, state="received", bytes=len(frame.payload)
            )
            self.events.publish(received)

    async def finish(self) -> None:
        """Wait until every received layer is in its cache."""
        if self.task is not None:
            await self.queue.put(None)
            await self.task

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def _retry_after(headers: Mapping[str, str]) -> float:
    try:
        return min(30.0, max(0.0, float(headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0
