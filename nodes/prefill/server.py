"""`POST /v1/prefill`: the prefill node's HTTP route (DESIGN.md).

The streamed prefill runs on the node's single device thread; each finished layer crosses to
the event loop through a small bounded queue (back-pressure: a slow network pauses compute
rather than piling K/V up in memory) and is written as a KV frame at once. One prefill at a
time per device; up to `queue_limit` more wait; beyond that the answer is 503 + Retry-After.
A client that goes away cancels the prefill: the device thread stops after its current layer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from aiohttp import web
from tandem.nodes.contract.events import EventBus, LayerEvent, LinkEvent, RequestEvent
from tandem.nodes.contract.frames import FrameWriter, Header
from tandem.nodes.contract.http import (
    DEFAULT_PREFILL_QUEUE,
    PROTO,
    BadBody,
    KVFormat,
    check_group_size,
    error_body,
    kv_format_of,
    read_json,
)
from tandem.nodes.prefill.engine import (
    LayerKV,
    PrefillEngine,
    PrefillError,
    PromptTooLong,
    quantized_parts,
)
from tandem.nodes.prefill.prefix_cache import PrefixCache
from tandem.nodes.prefill.stream.streamer import DEVICE_NICE, lower_this_thread
from tandem.nodes.serve.kv_link import tune_sender
from tandem.nodes.serve.throttle import PacedSender

log = logging.getLogger(__name__)
CONTENT_TYPE = "application/x-tandem-kv"
_WIRE_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    tokens: list[int]
    start: int
    kv_format: KVFormat | None = None  # None: K and V in the model's dtype


class BadRequest(Exception):
    """A `/v1/prefill` request refused: its HTTP status, error code and message."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def raw_bytes(t: torch.Tensor) -> memoryview:
    """Row-major bytes of a host tensor; bf16 as its raw bits."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return memoryview(t.numpy()).cast("B")


class PrefillService:
    """Owns the engine, its device thread and the request queue."""

    def __init__(
        self,
        build: Callable[[], PrefillEngine],
        fingerprint: str,
        events: EventBus,
        queue_limit: int = DEFAULT_PREFILL_QUEUE,
        net_gbps: float | None = None,
    ) -> None:
        self._build = build
        self._engine: PrefillEngine | None = None
        self.fingerprint = fingerprint
        self.events = events
        self.queue_limit = queue_limit
        self.device_thread = concurrent.futures.ThreadPoolExecutor(
            1, "tandem-device", initializer=self._device_thread_started
        )
        self._busy = asyncio.Semaphore(1)
        self._waiting = 0
        self._throttle = PacedSender(net_gbps)
        self.prefix_cache = PrefixCache()
        self.served_tokens = 0
        self.served_s = 0.0

    @property
    def prefill_tok_s(self) -> float | None:
        """Measured prefill rate over the requests served so far (tokens/s)."""
        return self.served_tokens / self.served_s if self.served_s > 0 else None

    def _device_thread_started(self) -> None:
        """On a CPU, compute (and the threads it starts) yields the CPU to this event loop:
        sending a finished layer is cheap and on the critical path, and a CPU prefill fills
        every core. On CUDA the loader it starts is the critical path, and a thread cannot
        raise its priority back: nothing is lowered. (The thread starts with the first
        request, after `start` built the engine.)"""
        if self._engine is None or self._engine.device.type == "cpu":
            lower_this_thread(DEVICE_NICE)

    async def start(self) -> PrefillEngine:
        """Build the engine (the plan, the weight pool) off the event loop."""
        self._engine = await asyncio.get_running_loop().run_in_executor(None, self._build)
        return self._engine

    @property
    def engine(self) -> PrefillEngine:
        if self._engine is None:
            raise BadRequest(503, "the prefill engine is still starting", "starting")
        return self._engine

    def close(self) -> None:
        self.device_thread.shutdown(wait=True, cancel_futures=True)
        if self._engine is not None:
            self._engine.close()

    def parse(self, body: object) -> PrefillRequest:
        if not isinstance(body, dict):
            raise BadRequest(400, "body must be a JSON object", "bad_request")
        proto = body.get("proto")
        if type(proto) is not int or proto != PROTO:
            raise BadRequest(400, f"proto must be {PROTO}", "protocol_mismatch")
        if body.get("fingerprint") != self.fingerprint:
            raise BadRequest(409, "model fingerprint does not match", "model_mismatch")
        engine = self.engine
        tokens, start = body.get("tokens"), body.get("start", 0)
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < engine.spec.vocab_size for t in tokens
        ):
            raise BadRequest(400, "tokens must be a list of ids in the vocabulary", "bad_tokens")
        if type(start) is not int or not 0 <= start < len(tokens):
            raise BadRequest(400, "start must satisfy 0 <= start < len(tokens)", "bad_tokens")
        spec = engine.spec
        context = spec.max_position_embeddings
        if len(tokens) > context:
            raise BadRequest(
                413, f"{len(tokens)} tokens exceed the model's context of {context}",
                "context_length_exceeded",
            )  # fmt: skip
        try:  # before any streaming: a prompt whose activations would not fit
            engine.check_fits(len(tokens))
        except PromptTooLong as e:
            raise BadRequest(413, str(e), "prompt_too_long") from None
        try:
            kv_format = kv_format_of(body)
            if kv_format is not None:
                check_group_size(kv_format.group_size, spec.head_dim)
        except ValueError as e:
            raise BadRequest(400, str(e), "bad_kv_format") from None
        rid = body.get("request_id")
        rid = rid if isinstance(rid, str) and rid else "prefill"
        return PrefillRequest(rid[:128], tokens, start, kv_format)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            req = self.parse(read_json(await request.read()))
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "request_too_large", "request body too large")
        except BadBody as e:
            return _error(400, "bad_json", str(e))
        except BadRequest as e:
            return _error(e.status, e.code, str(e))
        publish = self.events.publish
        if self._waiting >= self.queue_limit:
            publish(RequestEvent(req.request_id, phase="failed", detail="queue full (503)"))
            return _error(503, "busy", "prefill queue is full", {"Retry-After": "1"})
        publish(RequestEvent(req.request_id, phase="queued", tokens=len(req.tokens)))
        self._waiting += 1
        try:
            await self._busy.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._serve(request, req)
        finally:
            self._busy.release()

    async def _serve(self, request: web.Request, req: PrefillRequest) -> web.StreamResponse:
        spec = self.engine.spec
        count = len(req.tokens) - req.start
        header = Header(
            proto=PROTO,
            fingerprint=self.fingerprint,
            request_id=req.request_id,
            dtype=_WIRE_DTYPE[self.engine.dtype],
            layers=spec.num_layers,
            start=req.start,
            count=count,
            n_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            kv_bits=req.kv_format.bits if req.kv_format else 0,
            kv_group_size=req.kv_format.group_size if req.kv_format else 0,
        )
        writer = FrameWriter(header)
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        if request.transport is not None:
            tune_sender(request.transport.get_extra_info("socket"))
        await response.prepare(request)
        await response.write(writer.start())
        loop = asyncio.get_running_loop()
        layers: asyncio.Queue[LayerKV | BaseException | None] = asyncio.Queue(maxsize=2)
        cancel = threading.Event()
        publish = self.events.publish
        publish(RequestEvent(req.request_id, phase="prefill_start", tokens=count, where="remote"))
        t0 = time.perf_counter()
        job = loop.run_in_executor(self.device_thread, self._run, req, layers, loop, cancel)
        try:
            while (item := await layers.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if item.quantized is not None:
                    parts = {name: raw_bytes(t) for name, t in item.quantized.items()}
                    frame = writer.layer(item.layer, parts.pop("k"), parts.pop("v"), parts)
                else:
                    frame = writer.layer(item.layer, raw_bytes(item.k), raw_bytes(item.v))
                t_send = time.perf_counter()
                await self._throttle.send(response, frame)
                sent_s = time.perf_counter() - t_send
                publish(LinkEvent(req.request_id, name="net_out", bytes=len(frame), seconds=sent_s))
                publish(
                    LayerEvent(req.request_id, layer=item.layer, state="sent", bytes=len(frame))
                )
            await response.write(writer.done())
            await response.write_eof()
            elapsed = time.perf_counter() - t0
            self.served_s += elapsed
            publish(
                RequestEvent(req.request_id, phase="prefill_done", tokens=count, where="remote")
            )
        except (ConnectionResetError, asyncio.CancelledError):
            cancel.set()
            publish(RequestEvent(req.request_id, phase="cancelled", detail="client went away"))
            raise
        except PrefillError as e:
            await response.write(writer.error("bad_tokens", str(e)))
            publish(RequestEvent(req.request_id, phase="failed", detail=str(e)))
        except Exception as e:
            log.exception("prefill %s failed", req.request_id)
            cancel.set()
            await response.write(writer.error("internal", f"{type(e).__name__}: {e}"))
            publish(RequestEvent(req.request_id, phase="failed", detail=str(e)))
        finally:
            cancel.set()  # the device thread stops after its current layer
            await asyncio.gather(job, return_exceptions=True)
        return response

    def _run(
        self,
        req: PrefillRequest,
        out: asyncio.Queue[LayerKV | BaseException | None],
        loop: asyncio.AbstractEventLoop,
        cancel: threading.Event,
    ) -> None:
        """On the device thread: prefill every token, hand over positions start.. per layer."""

        def put(item: LayerKV | BaseException | None) -> None:
            fut = asyncio.run_coroutine_threadsafe(out.put(item), loop)
            while not cancel.is_set():
                try:
                    fut.result(timeout=0.1)
                    return
                except concurrent.futures.TimeoutError:
                    continue
            fut.cancel()

        j, prefix = self.prefix_cache.lookup(req.tokens)
        layers = self.engine.prefill(
            req.tokens[j:], start=j, prefix=prefix, request_id=req.request_id,
            kv_format=req.kv_format,
        )  # fmt: skip
        full: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for layer in layers:
                if cancel.is_set():
                    return
                k, v = layer.k, layer.v  # positions j..n-1
                if prefix is not None:
                    pk, pv = prefix[layer.layer]
                    k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
                full.append((k, v))  # the prefix cache keeps full precision
                sent = LayerKV(layer.layer, k[:, :, req.start :], v[:, :, req.start :])
                if req.kv_format is not None:
                    sent = replace(sent, quantized=_sent_quantized(layer, prefix, j, req))
                put(sent)
            self.prefix_cache.store(req.tokens, full)
            self.served_tokens += len(req.tokens) - j  # computed, not reused
            put(None)
        except BaseException as e:
            put(e)
        finally:
            layers.close()


def _sent_quantized(
    layer: LayerKV,
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None,
    j: int,
    req: PrefillRequest,
) -> dict[str, torch.Tensor]:
    """The quantized K/V of positions req.start.. : the engine's (positions j..) and, where
    the request starts inside the prefix cache's hit, that part quantized here (groups run
    along head_dim, so quantizing a concatenation is concatenating the quantized parts)."""
    assert req.kv_format is not None and layer.quantized is not None
    computed = {n: t[:, :, max(0, req.start - j) :] for n, t in layer.quantized.items()}
    if prefix is None or req.start >= j:
        return computed
    pk, pv = prefix[layer.layer]
    head = quantized_parts(pk[:, :, req.start :], pv[:, :, req.start :], req.kv_format)
    return {n: torch.cat([head[n], computed[n]], dim=2) for n in computed}


def _error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(error_body(message, code), status=status, headers=headers)
