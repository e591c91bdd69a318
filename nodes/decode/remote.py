"""The decode node's side of `/v1/prefill`: ask a prefill node for K/V and fill mlx caches
layer by layer as frames arrive (each checked, then put in by the model's decode family),
while the prefill node computes the next layer."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
from tandem.nodes.cluster.peers import PeerTable, UntrustedPeer
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.events import EventBus, LayerEvent, LinkEvent
from tandem.nodes.contract.frame_reader import FrameReader
from tandem.nodes.contract.frames import Done, ErrorFrame, Frame, Header, LayerFrame, ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import DecodeFamily, KVShape, LayerStepper, layer_arrays
from tandem.nodes.decode.families.llama import GenericFamily
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.model.spec import FULL, LayerKind
from tandem.nodes.serve import http_stream
from tandem.nodes.serve.http_stream import HttpError
from tandem.nodes.serve.kv_link import arrival_seconds

log = logging.getLogger(__name__)


class RemotePrefillError(Exception):
    """The prefill node could not deliver: unreachable, refused, garbage, or died mid-stream.

    `retry_after` (seconds) is set when the node said it is busy (503 + Retry-After)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# frames' transfer time / the compute's seen from here, beyond which the link, not the
# compute, may have set the request's time (a compute-bound request's frames all arrive
# while it computes, the last one's after: transfer < compute)
LINK_BOUND = 0.9


@dataclass(frozen=True)
class RemoteResult:
    node: str  # the prefill node's address
    tokens: int  # positions computed remotely
    kv_bytes: int  # response body bytes
    seconds: float  # request to last frame
    transfer_s: float  # layer frames' bytes at the rate they arrived (`arrival_seconds`)

    def compute_tok_s(self, layers: int) -> float | None:
        """The prefill's own rate, as the router models a request (the compute, then the last
        layer's frame): tokens / (seconds - transfer_s / layers). None where the link bound
        the request (its frames queued behind the wire, so the compute's time is not seen
        from here: counting it would charge the old link's time to every later request,
        whatever its KV format)."""
        compute_s = self.seconds - self.transfer_s / max(layers, 1)
        if not self.tokens or compute_s <= 0 or self.transfer_s >= LINK_BOUND * compute_s:
            return None
        return self.tokens / compute_s

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

    def give(self, payload: memoryview) -> None:
        """The buffer `payload` was read into is free again (nothing else refers to it)."""
        buffer = payload.obj
        kept = sum(len(b) for b in self._free)
        if isinstance(buffer, bytearray) and kept + len(buffer) <= self.keep_bytes:
            self._free.append(buffer)


@dataclass(frozen=True)
class PrefillCall:
    """One `/v1/prefill` request: fill caches holding 0..start-1 with start..len(tokens)-1."""

    request_id: str
    tokens: list[int]
    start: int
    timeout_s: float = 300.0
    kv_format: KVFormat | None = None  # K and V quantized on the wire (None: model dtype)

    @property
    def count(self) -> int:
        return len(self.tokens) - self.start


class RemotePrefill:
    """The decode node's client of one model's prefill nodes: POSTs `/v1/prefill`, reads the
    KV frames in place (`FrameReader` into `BufferPool` buffers), times each frame as it
    arrives (its `net_in` link event) and hands the layers to an `_Assembler`, which appends
    them to the caches on the mlx thread while the next frames arrive.

    A call publishes its link and layer events on the bus it is given; a call given none (a
    calibration probe) runs quiet."""

    def __init__(
        self,
        host: ModelHost,
        expect: KVShape,
        fingerprint: str,
        peers: PeerTable,
        buffers: BufferPool | None = None,
        family: DecodeFamily | None = None,
        kinds: Sequence[LayerKind] | None = None,
    ) -> None:
        self.host, self.expect, self.fingerprint = host, expect, fingerprint
        self.peers = peers  # signs each request for its callee
        self.buffers = buffers or BufferPool()
        self.family, self.kinds = family, kinds  # how frames fill each layer's cache

    async def __call__(
        self,
        url: str,
        call: PrefillCall,
        caches: lm.Caches,
        events: EventBus | None = None,
        stepper: LayerStepper | None = None,
    ) -> RemoteResult:
        """Fill `caches` from the prefill node at `url`, publishing on `events` (None: quiet);
        RemotePrefillError on any failure (the caches may then hold a partial prefix:
        `lm.trim_to` them), and the moment the peer table stops trusting `url` (the request
        is then abandoned). `stepper` advances through layer i on the mlx thread right after
        layer i is in its cache. A frame the caches refuse (its values, its shape) ends the
        request at once, whatever the node still sends."""
        assembler = _Assembler(self, caches, events, call, stepper)
        task = asyncio.create_task(self._fetch(url, call, assembler), name="remote-prefill")
        broken = asyncio.create_task(assembler.failed.wait(), name="kv-refused")
        with self.peers.until_untrusted(url) as lost:
            untrusted = asyncio.create_task(lost.wait(), name="peer-trust")
            try:
                await asyncio.wait({task, untrusted, broken}, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                if broken.done():
                    e = assembler.error
                    raise RemotePrefillError(f"{url}: {type(e).__name__}: {e}") from e
                peer = self.peers.peers.get(url)
                reason = peer.reason if peer is not None else "gone"
                raise RemotePrefillError(f"{url} is no longer trusted ({reason})")
            finally:
                for t in (task, untrusted, broken):
                    t.cancel()
                await asyncio.gather(task, untrusted, broken, return_exceptions=True)

    async def _fetch(self, url: str, call: PrefillCall, assembler: _Assembler) -> RemoteResult:
        """The request itself: POST, then each frame into its layer's cache as it lands."""
        body = PrefillBody(
            self.fingerprint, call.request_id, call.tokens, call.start, call.kv_format
        )
        data = json.dumps(body.to_json()).encode()
        try:  # signed for the node it proved to be; no client's header is ever forwarded
            link = self.peers.signed(url, "POST", "/v1/prefill", data)
        except UntrustedPeer as e:
            raise RemotePrefillError(str(e)) from None
        t0 = time.perf_counter()
        reader = FrameReader(alloc=self.buffers.take)
        clock = _FrameClock(assembler.events, call.request_id)
        try:
            async with (
                asyncio.timeout(call.timeout_s),
                http_stream.post(
                    f"{url}/v1/prefill",
                    data,
                    link.headers,
                    read_timeout_s=min(60.0, call.timeout_s),
                    pin=link.pin,
                    prove=self.peers.prover(url),
                ) as resp,
            ):
                if resp.status != 200:
                    detail = (await resp.read(300)).decode(errors="replace")
                    retry = retry_after(resp.headers) if resp.status == 503 else None
                    raise RemotePrefillError(f"{url} answered {resp.status}: {detail}", retry)
                while n := await resp.read_into(reader.get_buffer()):
                    clock.read(n, resp.conn.received)
                    for frame in reader.buffer_updated(n):
                        clock.frame(frame)
                        await assembler.take(frame)
                        await asyncio.sleep(0)  # reads that never wait would starve the loop
                reader.finish()
                await assembler.finish()
        except RemotePrefillError:
            raise
        except UntrustedPeer as e:
            raise RemotePrefillError(str(e)) from None
        except (HttpError, TimeoutError, OSError, ProtocolError, ValueError) as e:
            raise RemotePrefillError(f"{url}: {type(e).__name__}: {e}") from e
        finally:
            await assembler.close()
        seconds = time.perf_counter() - t0
        return RemoteResult(url, call.count, clock.total, seconds, clock.transfer_s)


class _FrameClock:
    """A layer frame's receive time: its reads from the first to the last, at the rate of
    the bytes after the first (a read never runs past its frame: the reader gives the
    buffer), published as a `net_in` link event (on a bus, if any)."""

    def __init__(self, events: EventBus | None, request_id: str) -> None:
        self.events, self.request_id = events, request_id
        self.total = 0  # body bytes
        self.transfer_s = 0.0
        self._first: tuple[float, int] | None = None  # at a frame's first read: time, bytes in
        self._last: tuple[float, int] = (0.0, 0)

    def read(self, n: int, received: int) -> None:
        now = time.perf_counter()
        self.total += n
        self._first = self._first or (now, received)
        self._last = (now, received)

    def frame(self, frame: Frame) -> None:
        if isinstance(frame, LayerFrame) and self._first is not None:
            size = frame.wire_bytes
            (t_first, r_first), (t_last, r_last) = self._first, self._last
            seconds = arrival_seconds(size, t_last - t_first, r_last - r_first)
            self.transfer_s += seconds
            if self.events is not None:
                self.events.publish(
                    LinkEvent(self.request_id, name="net_in", bytes=size, seconds=seconds)
                )
        self._first = None


class _Assembler:
    """Applies layer frames to the caches on the mlx thread while the network keeps reading:
    layer i goes into its cache as layer i+1 arrives (a few frames of slack, then
    back-pressure on the connection). Right after layer i is in, `stepper` runs the last
    prompt token through it, on the same hop."""

    def __init__(
        self,
        client: RemotePrefill,
        caches: lm.Caches,
        events: EventBus | None,
        call: PrefillCall,
        stepper: LayerStepper | None,
    ) -> None:
        self.client, self.caches, self.events, self.call = client, caches, events, call
        self.stepper = stepper
        self.queue: asyncio.Queue[LayerFrame | None] = asyncio.Queue(maxsize=4)
        self.task: asyncio.Task[None] | None = None
        self.builder: CacheBuilder | None = None
        self.failed = asyncio.Event()  # a frame was refused: `error` says why
        self.error: BaseException | None = None

    async def take(self, frame: Frame) -> None:
        if isinstance(frame, ErrorFrame):
            raise RemotePrefillError(f"prefill node error {frame.code}: {frame.message}")
        if isinstance(frame, Header):
            client = self.client
            self.builder = CacheBuilder(
                frame, self.caches, client.expect, self.call.start, self.call.count,
                self.call.kv_format, client.family, client.kinds,
            )  # fmt: skip
            self.task = asyncio.create_task(self._apply_all(), name="kv-assembly")
        elif isinstance(frame, LayerFrame):
            assert self.task is not None  # the reader guarantees a header first
            if self.task.done():
                await self.task  # it failed: raise its error here
            await self.queue.put(frame)
        elif isinstance(frame, Done):
            log.debug("request %s: %d layers received", self.call.request_id, frame.layers)

    async def _apply_all(self) -> None:
        try:
            await self._apply_each()
        except Exception as e:  # the request ends now: its reader may be waiting to put
            self.error = e
            self.failed.set()
            raise

    async def _apply_each(self) -> None:
        assert self.builder is not None
        host = self.client.host
        while (frame := await self.queue.get()) is not None:
            await host.thread.call(self._add, frame)
            self.client.buffers.give(frame.payload)  # copied into the cache: the buffer is free
            if self.events is not None:
                received = LayerEvent(
                    self.call.request_id, layer=frame.layer, state="received",
                    bytes=len(frame.payload),
                )  # fmt: skip
                self.events.publish(received)

    def _add(self, frame: LayerFrame) -> None:
        assert self.builder is not None
        self.builder.add(frame)
        if self.stepper is not None:
            self.stepper.advance(frame.layer)

    async def finish(self) -> None:
        """Wait until every received layer is in its cache."""
        if self.task is not None:
            await self.queue.put(None)
            await self.task

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)


class CacheBuilder:
    """Puts each layer's new positions into that layer's cache (the prefix already there)
    through the model's family, once the header (`KVShape.check`) and each frame
    (`layer_arrays`) agree with the model and the request."""

    def __init__(
        self,
        header: Header,
        caches: lm.Caches,
        expect: KVShape,
        start: int,
        count: int,
        kv_format: KVFormat | None = None,
        family: DecodeFamily | None = None,
        kinds: Sequence[LayerKind] | None = None,
    ) -> None:
        self.kinds = tuple(kinds) if kinds is not None else (FULL,) * expect.layers
        expect.check(header, caches, start, count, kv_format, self.kinds)
        self.header, self.caches, self.kv_format = header, caches, kv_format
        self.family = family or GenericFamily()

    def add(self, frame: LayerFrame) -> None:
        """On the mlx thread: check the layer's values and put them into its cache."""
        arrays = layer_arrays(frame, self.header)
        i = frame.layer
        first = getattr(self.caches, "first", 0)  # a decode group: rank 0 holds the last
        if i < first:  # another rank's layer: its arrays to it
            self.caches.mirror.fill(self.caches, arrays, self.kv_format)  # type: ignore[attr-defined]
            return
        j = i - first
        self.caches[j] = self.family.fill(self.kinds[i], self.caches[j], arrays, self.kv_format)
        mx.eval(self.caches[j].state[:2])  # (K, V), or a state cache's (slots, padding)


RETRY_FLOOR_S = 0.5  # a busy node's Retry-After below this (0, nan) is read as this
RETRY_CAP_S = 30.0


def retry_after(headers: Mapping[str, str]) -> float:
    """A 503's Retry-After in seconds, within [RETRY_FLOOR_S, RETRY_CAP_S] (1 s if unreadable)."""
    try:
        value = float(headers.get("retry-after", "1"))
    except ValueError:
        return 1.0
    if math.isnan(value):
        return 1.0
    return min(RETRY_CAP_S, max(RETRY_FLOOR_S, value))
