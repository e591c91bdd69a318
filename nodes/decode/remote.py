"""The decode node's side of `/v1/prefill`: ask a prefill node for K/V and fill mlx caches
layer by layer as frames arrive, while the prefill node computes the next layer."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from nodes.auth import auth_headers
from nodes.decode.host import ModelHost
from nodes.decode.kv import CacheBuilder
from nodes.events import EventBus, LayerEvent, LinkEvent
from nodes.wire import PREFIX, PROTO, Done, ErrorFrame, Frame, FrameReader, Header, LayerKV

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
    transfer_s: float  # time spent receiving layer frames (their first to last byte)

    @property
    def prefill_tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens else None

    @property
    def link_Bps(self) -> float | None:
        return self.kv_bytes / self.transfer_s if self.transfer_s > 0 else None


async def remote_prefill(
    session: aiohttp.ClientSession,
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
    reader = FrameReader()
    assembler = _Assembler(host, caches, events, request_id, start)
    total = 0
    transfer_s = 0.0
    try:
        async with session.post(
            f"{url}/v1/prefill",
            json=body,
            headers=auth_headers(token),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_read=min(60.0, timeout_s)),
        ) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:300]
                retry = _retry_after(resp) if resp.status == 503 else None
                raise RemotePrefillError(f"{url} answered {resp.status}: {detail}", retry)
            # a frame's receive time: from the chunk with its first byte to the one with its last
            frame_start: float | None = None
            async for chunk in resp.content.iter_any():
                arrived = time.perf_counter()
                frame_start = frame_start or arrived
                total += len(chunk)
                frames = reader.feed(chunk)
                for frame in frames:
                    if isinstance(frame, LayerKV):
                        n = PREFIX.size + len(frame.payload)
                        seconds = arrived - frame_start
                        transfer_s += seconds
                        link = LinkEvent(request_id, name="net_in", bytes=n, seconds=seconds)
                        events.publish(link)
                    await assembler.take(frame)
                if frames:  # the next frame's first byte came in this chunk or comes later
                    frame_start = arrived if reader.mid_frame else None
            reader.finish()
            await assembler.finish()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
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
        self, host: ModelHost, caches: list[Any], events: EventBus, request_id: str, start: int
    ) -> None:
        self.host, self.caches, self.events = host, caches, events
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


def _retry_after(resp: aiohttp.ClientResponse) -> float:
    try:
        return min(30.0, max(0.0, float(resp.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0
