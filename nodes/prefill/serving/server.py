"""`POST /v1/prefill`: the prefill node's HTTP route (DESIGN.md).

The engine is built, used and closed on the node's single device thread (`DeviceThread`); a
pass runs there as a `DeviceStream` whose finished layers cross to the event loop, each
written as a KV frame at once by its request's own handler. One
pass at a time per device, serving every request waiting when it starts (`passes.py`); up
to `queue_limit` more wait; beyond that the answer is 503 + Retry-After. Each request's frames
are its own: a client that goes away leaves its pass (the others go on; a pass nobody reads
stops after its current layer), and so does one that stops reading (a Mac asleep
mid-transfer): a frame none of whose bytes it takes within `stall_s` drops its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from aiohttp import web
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.cluster import PrefillQueue
from tandem.nodes.contract.events import EventBus, LayerEvent, LinkEvent, RequestEvent
from tandem.nodes.contract.frames import FrameWriter, Header
from tandem.nodes.contract.http import (
    DEFAULT_PREFILL_QUEUE,
    DEFAULT_STALL_TIMEOUT_S,
    PROTO,
    ApiError,
    check_group_size,
)
from tandem.nodes.contract.ranks import PrefillRanks
from tandem.nodes.model.kv_bytes import latent_widths, state_tensors
from tandem.nodes.prefill.dtypes import SAFETENSORS_DTYPES
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.errors import PrefillError, PromptTooLong
from tandem.nodes.prefill.handover import Handed, LinearState
from tandem.nodes.prefill.serving.passes import Passes, Waiter
from tandem.nodes.prefill.serving.prefix_cache import PrefixCache, reusing_pass
from tandem.nodes.prefill.stream.streamer import DEVICE_NICE, lower_this_thread
from tandem.nodes.serve.device import DeviceThread
from tandem.nodes.serve.errors import read_json_body
from tandem.nodes.serve.kv_link import tune_sender
from tandem.nodes.serve.metrics import PrefillMetrics
from tandem.nodes.serve.throttle import PacedSender

log = logging.getLogger(__name__)
CONTENT_TYPE = "application/x-tandem-kv"


class ReaderStalled(Exception):
    """The prefill's reader took nothing of a frame within the stall timeout."""


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
        stall_s: float = DEFAULT_STALL_TIMEOUT_S,
        max_batch_tokens: int | None = None,
        metrics: PrefillMetrics | None = None,
    ) -> None:
        self._build = build
        self.metrics = PrefillMetrics() if metrics is None else metrics  # None: read by nobody
        self.stall_s = stall_s
        self._engine: PrefillEngine | None = None
        self.fingerprint = fingerprint
        self.events = events
        self.queue_limit = queue_limit
        self._building = False  # `start` sets the thread's priority once the device is known
        self.device_thread = DeviceThread("tandem-device", self._device_thread_started)
        self.passes = Passes(self.device_thread, events, queue_limit, self._pass_done)
        self.max_batch_tokens = max_batch_tokens  # None: the engine's longest prompt
        self._throttle = PacedSender(net_gbps)
        self.prefix_cache = PrefixCache()

    @property
    def prefill_tok_s(self) -> float | None:
        """Measured prefill rate over the passes served so far (tokens/s)."""
        p = self.passes
        return p.served_tokens / p.served_s if p.served_s > 0 else None

    @property
    def last_reused(self) -> int:
        """Positions the last request took from the prefix cache."""
        return self.passes.last_reused

    def _device_thread_started(self) -> None:
        """On a CPU, compute (and the threads it starts) yields the CPU to this event loop:
        sending a finished layer is cheap and on the critical path, and a CPU prefill fills
        every core. On CUDA the loader it starts is the critical path, and a thread cannot
        raise its priority back: nothing is lowered. (The thread starts with `start`, which
        lowers it after the build, once the engine's device is known.)"""
        if self._building:
            return
        if self._engine is None or self._engine.device.type == "cpu":
            lower_this_thread(DEVICE_NICE)

    def _build_here(self) -> PrefillEngine:
        """On the device thread: the engine (the plan, the weight pool), then the thread's
        priority for its device (the build runs at the loop's priority, as it always did)."""
        engine = self._build()
        if engine.device.type == "cpu":
            lower_this_thread(DEVICE_NICE)
        return engine

    async def start(self) -> PrefillEngine:
        """Build the engine on its device thread, off the event loop."""
        self._building = True
        self._engine = await self.device_thread.call(self._build_here)
        engine = self._engine
        if engine.prefix_cache_bytes is not None:  # sized with the RAM tier
            self.prefix_cache.max_bytes = engine.prefix_cache_bytes
        self.passes.work = partial(reusing_pass, engine, self.prefix_cache)
        self.passes.in_step = engine.collective is not None
        # a pass's prompts share the activation reserve: together, one longest prompt
        self.passes.max_batch_tokens = self.max_batch_tokens or engine.request_tokens
        log.info("prefix cache: %d B; a pass takes prompts of %d tokens in all",
                 self.prefix_cache.max_bytes, self.passes.max_batch_tokens)  # fmt: skip
        return engine

    async def stop(self) -> None:
        """Cancel the pass in flight (the node is stopping; `close` then ends the thread)."""
        await self.passes.stop()

    @property
    def engine(self) -> PrefillEngine:
        if self._engine is None:
            raise ApiError(503, "the prefill engine is still starting", "starting")
        return self._engine

    def close(self) -> None:
        """Close the engine on its device thread, then end the thread (blocks)."""
        if self._engine is not None:
            self.device_thread.submit(self._engine.close).result()
            if self._engine.collective is not None:  # the node's ranks: this one leaves
                self.device_thread.submit(self._engine.collective.close).result()
        self.device_thread.close()

    def parse(self, body: object) -> PrefillBody:
        """The `/v1/prefill` body, if this node can serve it: a ContractError for a body
        that is not one, an ApiError for what this model refuses."""
        lost = self.lost
        if lost:  # a rank of this node is gone: it stops in a moment
            raise ApiError(503, lost, "rank_lost")
        req = PrefillBody.from_json(body)
        if req.fingerprint != self.fingerprint:
            raise ApiError(409, "model fingerprint does not match", "model_mismatch")
        engine = self.engine
        spec = engine.spec
        if any(t >= spec.vocab_size for t in req.tokens):
            raise ApiError(400, "tokens must be a list of ids in the vocabulary", "bad_tokens")
        context = spec.max_position_embeddings
        if len(req.tokens) > context:
            raise ApiError(
                413, f"{len(req.tokens)} tokens exceed the model's context of {context}",
                "context_length_exceeded",
            )  # fmt: skip
        try:  # before any streaming: a prompt whose activations would not fit
            engine.check_fits(len(req.tokens))
        except PromptTooLong as e:
            raise ApiError(413, str(e), "prompt_too_long") from None
        try:
            if req.kv_format is not None:
                check_group_size(req.kv_format.group_size, spec.head_dim)
        except ValueError as e:
            raise ApiError(400, str(e), "bad_kv_format") from None
        return req

    async def handle(self, request: web.Request) -> web.StreamResponse:
        req = self.parse(await read_json_body(request))  # ApiError: the node's middleware answers
        waiter = self.passes.join(req)
        try:
            return await self._serve(request, waiter)
        finally:
            self.passes.leave(waiter)  # done, or gone: its pass skips it from now on

    @property
    def lost(self) -> str | None:
        """Why this node's ranks are broken; None while they run (or it has one device)."""
        c = self._engine.collective if self._engine is not None else None
        return c.lost if c is not None else None

    def ranks(self) -> PrefillRanks | None:
        """The node's ranks (`/health`); None for one device."""
        c = self._engine.collective if self._engine is not None else None
        return c.health() if c is not None else None

    def queue(self) -> PrefillQueue:
        """What a prefill that arrives now would wait behind (`/health`)."""
        return self.passes.queue()

    def _pass_done(self, reqs: Sequence[PrefillBody], seconds: float, computed: list[int]) -> None:
        """A pass ran (on the loop, the device thread done with it): its metrics, with the
        engine's stats of it (the pass's last request's: the streamer's bytes are the pass's)."""
        self.metrics.pass_done(reqs, seconds, computed, self.engine.last_stats)

    async def _serve(self, request: web.Request, waiter: Waiter) -> web.StreamResponse:
        req, spec = waiter.req, self.engine.spec
        count = len(req.tokens) - req.start
        header = Header(
            proto=PROTO,
            fingerprint=self.fingerprint,
            request_id=req.request_id,
            dtype=SAFETENSORS_DTYPES[self.engine.dtype],
            layers=spec.num_layers,
            start=req.start,
            count=count,
            n_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            kv_bits=req.kv_format.bits if req.kv_format else 0,
            kv_group_size=req.kv_format.group_size if req.kv_format else 0,
            kinds=tuple(kind.kind for kind in spec.layer_kinds),
            windows=tuple(kind.window or 0 for kind in spec.layer_kinds),
            state=state_tensors(spec, SAFETENSORS_DTYPES[self.engine.dtype]),
            latent=latent_widths(spec),
        )
        writer = FrameWriter(header)
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        if request.transport is not None:
            tune_sender(request.transport.get_extra_info("socket"))
        await response.prepare(request)
        await response.write(writer.start())
        publish = self.events.publish
        try:
            while (item := await waiter.next()) is not None:  # its layers, as its pass does them
                await self._send(response, writer, req.request_id, item)
            await response.write(writer.done())
            await response.write_eof()
            reused = f"{len(req.tokens) - waiter.computed} positions from the prefix cache"
            publish(RequestEvent(req.request_id, phase="prefill_done", tokens=count,
                                 where="remote", detail=reused))  # fmt: skip
        except (ConnectionResetError, asyncio.CancelledError):
            publish(RequestEvent(req.request_id, phase="cancelled", detail="client went away"))
            raise
        except ReaderStalled as e:
            log.warning("prefill %s: %s; its stream is dropped", req.request_id, e)
            publish(RequestEvent(req.request_id, phase="failed", detail=str(e)))
            if request.transport is not None:
                request.transport.abort()  # what it has not read is never sent
        except PrefillError as e:
            await response.write(writer.error("bad_tokens", str(e)))
            publish(RequestEvent(req.request_id, phase="failed", detail=str(e)))
        except Exception as e:
            log.exception("prefill %s failed", req.request_id)
            await response.write(writer.error("internal", f"{type(e).__name__}: {e}"))
            publish(RequestEvent(req.request_id, phase="failed", detail=str(e)))
        return response

    async def _send(
        self, response: web.StreamResponse, writer: FrameWriter, rid: str, item: Handed
    ) -> None:
        """One layer's K/V (or state) as a frame, paced (`--net-gbps`), with its link and
        layer events."""
        if isinstance(item, LinearState):
            frame = writer.tensors(item.layer, {n: raw_bytes(t) for n, t in item.tensors.items()})
        elif item.quantized is not None:
            parts = {name: raw_bytes(t) for name, t in item.quantized.items()}
            frame = writer.layer(item.layer, parts.pop("k"), parts.pop("v"), parts)
        else:
            frame = writer.layer(item.layer, raw_bytes(item.k), raw_bytes(item.v))
        t_send = time.perf_counter()
        paced_s = len(frame) / self._throttle.rate if self._throttle.rate else 0.0
        try:
            await asyncio.wait_for(self._throttle.send(response, frame), self.stall_s + paced_s)
        except TimeoutError:
            raise ReaderStalled(
                f"the reader took none of layer {item.layer}'s frame for {self.stall_s:.0f} s"
            ) from None
        sent_s = time.perf_counter() - t_send
        publish = self.events.publish
        publish(LinkEvent(rid, name="net_out", bytes=len(frame), seconds=sent_s))
        publish(LayerEvent(rid, layer=item.layer, state="sent", bytes=len(frame)))
