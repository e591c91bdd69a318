"""The decode node's OpenAI-compatible API: `/v1/models`, `/v1/chat/completions`,
`/v1/completions`, streamed (SSE) or not, each reply carrying the `tandem` object.

A request: tokenize (chat template) → route the prefill (local mlx or a trusted prefill
node over `/v1/prefill`) → decode with mlx-lm from the filled cache. A remote failure of any
kind falls back to a local prefill: the client gets the right answer, and a `request` event
with phase `failed` says why. A client that disconnects cancels its decode and its remote
prefill (aiohttp cancels the handler; the mlx thread sees the cancel flag).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from nodes.decode.host import Cancelled, Generation, ModelHost, SamplingParams
from nodes.decode.prompt_cache import PromptCache
from nodes.decode.remote import BufferPool, RemotePrefillError, remote_prefill
from nodes.decode.router import LocalRate, Mode, choose
from nodes.events import EventBus, RequestEvent, TokenEvent
from nodes.model.spec import ModelSpec
from nodes.peers import PeerTable

log = logging.getLogger(__name__)
MAX_STOP = 4


class ApiError(Exception):
    """A request we refuse; becomes an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": code, "param": None, "code": code}}
    return web.json_response(body, status=status)


@dataclass(frozen=True)
class Completion:
    request_id: str
    tokens: list[int]
    params: SamplingParams
    stream: bool
    chat: bool


@dataclass
class PrefillInfo:
    where: str = "local"
    node: str | None = None
    tokens: int = 0
    seconds: float = 0.0
    kv_bytes: int = 0


class DecodeService:
    """Handlers for the OpenAI routes; one per node."""

    def __init__(
        self,
        host: ModelHost,
        spec: ModelSpec,
        fingerprint: str,
        events: EventBus,
        peers: PeerTable,
        token: str | None,
        mode: Mode = "auto",
        max_tokens_limit: int = 4096,
    ) -> None:
        self.host = host
        self.spec = spec
        self.fingerprint = fingerprint
        self.events = events
        self.peers = peers
        self.frame_buffers = BufferPool()  # KV frames are read into these, reused
        self.token = token
        self.mode = mode
        self.max_tokens_limit = max_tokens_limit
        self.local = LocalRate()  # measured mlx prefill rate and floor
        self.prompt_cache = PromptCache()
        self.remote_timeout_s = 300.0
        self.model_name = spec.name

    async def calibrate(self, tokens: int = 128) -> LocalRate:
        """Measure this node's local (mlx) prefill rate and floor for the router."""
        floor = await self.host.call(self.host.measure_prefill, 1)
        rate = await self.host.call(self.host.measure_prefill, tokens)
        self.local = LocalRate(tok_s=tokens / rate, floor_s=floor)
        log.info("local prefill: %.0f tokens/s, floor %.1f ms", tokens / rate, floor * 1e3)
        return self.local

    async def probe_peers(self) -> None:
        """Keep calibrating: measure each newly trusted prefill node with a tiny prefill."""
        while True:
            for peer in self.peers.trusted("prefill"):
                if peer.prefill_floor_s is None:
                    await self._probe(peer.address)
            await asyncio.sleep(1.0)

    async def _probe(self, address: str, count: int = 8) -> None:
        caches = await self.host.call(self.host.new_cache)
        tokens = [(5 * i + 1) % self.spec.vocab_size for i in range(count)]
        try:
            result = await remote_prefill(
                address, self.token, fingerprint=self.fingerprint,
                request_id=f"probe-{uuid.uuid4().hex[:8]}", tokens=tokens, start=0,
                host=self.host, caches=caches, events=EventBus(), timeout_s=30.0,
                buffers=self.frame_buffers,
            )  # fmt: skip
        except RemotePrefillError as e:
            log.info("probe of %s failed: %s", address, e)
            self.peers.update_rates(address, seconds=30.0)
            return
        self.peers.update_rates(address, None, result.link_Bps, result.seconds)
        log.info("prefill node %s: pass floor %.1f ms", address, result.seconds * 1e3)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem"}
        return web.json_response({"object": "list", "data": [model]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list")
            for m in messages:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise ApiError(400, "each message needs a role and a content")
                if not isinstance(m.get("content"), str):
                    raise ApiError(400, "message content must be a string")
            msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
            tokens = await self.host.call(self.host.chat_tokens, msgs)
            req = self._completion(body, tokens, chat=True)
        except ApiError as e:
            return error_response(e.status, str(e), e.code)
        return await self._respond(request, req)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                if not all(0 <= t < self.spec.vocab_size for t in prompt):
                    raise ApiError(400, "prompt token id outside the vocabulary")
                tokens = list(prompt)  # OpenAI allows a prompt of token ids
            elif isinstance(prompt, str) and prompt:
                tokens = await self.host.call(self.host.encode, prompt)
            else:
                raise ApiError(400, "prompt must be a non-empty string or list of token ids")
            req = self._completion(body, tokens, chat=False)
        except ApiError as e:
            return error_response(e.status, str(e), e.code)
        return await self._respond(request, req)

    def _completion(self, body: dict[str, Any], tokens: list[int], chat: bool) -> Completion:
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens")) or 256
        if type(max_tokens) is not int or not 1 <= max_tokens <= self.max_tokens_limit:
            raise ApiError(400, f"max_tokens must be an integer in 1..{self.max_tokens_limit}")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, list | tuple) or len(stop) > MAX_STOP:
            raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOP}")
        if not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop strings must be strings")
        seed = body.get("seed")
        if seed is not None and type(seed) is not int:
            raise ApiError(400, "seed must be an integer")
        if not tokens:
            raise ApiError(400, "the prompt is empty after tokenization")
        context = self.spec.max_position_embeddings
        if len(tokens) + max_tokens > context:
            raise ApiError(
                400,
                f"prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {context} tokens",
                "context_length_exceeded",
            )
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Completion(
            request_id=prefix + uuid.uuid4().hex[:24],
            tokens=tokens,
            params=SamplingParams(max_tokens, temperature, top_p, tuple(stop), seed),
            stream=bool(body.get("stream", False)),
            chat=chat,
        )

    async def _respond(self, request: web.Request, req: Completion) -> web.StreamResponse:
        rid = req.request_id
        self.events.publish(RequestEvent(rid, phase="queued", tokens=len(req.tokens)))
        cancel = threading.Event()
        t0 = time.perf_counter()
        response: web.StreamResponse | None = None
        try:
            caches, info = await self._prefill(req)
            loop = asyncio.get_running_loop()
            texts: asyncio.Queue[str] = asyncio.Queue()
            ticker = _TokenTicker(self.events, rid)

            def on_text(text: str) -> None:
                loop.call_soon_threadsafe(texts.put_nowait, text)

            held = caches[0].offset if caches else 0  # positions already in the cache
            job = loop.run_in_executor(
                self.host.thread,
                self.host.generate,
                req.tokens[held:],
                caches,
                req.params,
                cancel,
                on_text,
                ticker.tick,
            )
            if req.stream:
                response = await self._stream(request, req, job, texts)
            gen = await job
            ticker.flush(gen.tokens)
            await self.host.call(self._remember, req.tokens + gen.token_ids, caches)
            if info.where == "local":
                info.seconds = gen.first_token_s
            self.events.publish(
                RequestEvent(rid, phase="done", tokens=gen.tokens, where=info.where)
            )
            ttft = (gen.first_token_at or time.perf_counter()) - t0
            extra = self._tandem(req, info, gen, ttft)
            if response is not None:
                await self._finish_stream(response, req, gen, extra)
                return response
            return web.json_response(self._body(req, gen, extra))
        except (asyncio.CancelledError, ConnectionResetError, Cancelled):
            cancel.set()
            self.events.publish(RequestEvent(rid, phase="cancelled", detail="client went away"))
            raise
        finally:
            cancel.set()

    def _remember(self, tokens: list[int], caches: list[Any]) -> None:
        """On the mlx thread: keep this conversation's KV for its next turn."""
        offset = caches[0].offset
        if offset <= len(tokens):
            self.prompt_cache.store(tokens[:offset], caches)

    async def _prefill(self, req: Completion) -> tuple[list[Any], PrefillInfo]:
        """Caches holding positions 0..k-1, k = n-1 after a remote prefill; mlx-lm prefills
        whatever the cache lacks locally. The prompt cache supplies a reused prefix first."""
        rid, n = req.request_id, len(req.tokens) - 1
        k, reused = await self.host.call(self.prompt_cache.lookup, req.tokens)
        caches = reused if reused is not None else await self.host.call(self.host.new_cache)
        new = n - k  # positions that need a prefill
        peers = self.peers.trusted("prefill")
        decision = choose(
            self.mode, new, self.spec.kv_bytes_per_token, self.spec.num_layers,
            self.local, peers,
        )  # fmt: skip
        if decision.where == "local":
            if self.mode == "always" and new > 0:
                self.events.publish(RequestEvent(rid, phase="failed", detail=decision.reason))
            self.events.publish(RequestEvent(rid, phase="prefill_start", tokens=new, where="local"))
            return caches, PrefillInfo("local", None, new)
        peer = decision.peer
        assert peer is not None
        self.events.publish(
            RequestEvent(rid, phase="prefill_start", tokens=new, where=peer.address)
        )
        deadline = time.monotonic() + self.remote_timeout_s
        while True:
            try:
                result = await remote_prefill(
                    peer.address,
                    self.token,
                    fingerprint=self.fingerprint,
                    request_id=rid,
                    tokens=req.tokens[:-1],
                    start=k,
                    host=self.host,
                    caches=caches,
                    events=self.events,
                    timeout_s=max(1.0, deadline - time.monotonic()),
                    buffers=self.frame_buffers,
                )
                break
            except RemotePrefillError as e:
                await self.host.call(_trim_to, caches, k)
                wait = e.retry_after
                if wait is not None and time.monotonic() + wait < deadline:
                    log.info("prefill node busy, retrying in %.1f s", wait)
                    await asyncio.sleep(wait)
                    continue
                log.warning("remote prefill failed, prefilling locally: %s", e)
                failed = RequestEvent(rid, phase="failed", detail=str(e), where="remote")
                self.events.publish(failed)
                return caches, PrefillInfo("local", None, new)
        # a pass near the floor says nothing about the marginal rate
        rate = result.prefill_tok_s if result.seconds > 2 * (peer.prefill_floor_s or 0) else None
        self.peers.update_rates(peer.address, rate, result.link_Bps, result.seconds)
        self.events.publish(RequestEvent(rid, phase="prefill_done", tokens=new, where=peer.address))
        return caches, PrefillInfo("remote", peer.address, new, result.seconds, result.kv_bytes)

    async def _stream(
        self,
        request: web.Request,
        req: Completion,
        job: asyncio.Future[Generation],
        texts: asyncio.Queue[str],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if req.chat:
            await _sse(response, self._chunk(req, {"role": "assistant", "content": ""}, None))
        while True:
            getter = asyncio.ensure_future(texts.get())
            await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                while not texts.empty():
                    await self._send_text(response, req, texts.get_nowait())
                return response
            await self._send_text(response, req, getter.result())

    async def _send_text(self, response: web.StreamResponse, req: Completion, text: str) -> None:
        delta = {"content": text} if req.chat else text
        await _sse(response, self._chunk(req, delta, None))

    async def _finish_stream(
        self,
        response: web.StreamResponse,
        req: Completion,
        gen: Generation,
        extra: dict[str, Any],
    ) -> None:
        last = self._chunk(req, {} if req.chat else "", gen.finish_reason)
        last["usage"] = _usage(req, gen)
        last["tandem"] = extra
        await _sse(response, last)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    def _chunk(self, req: Completion, delta: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if req.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
            choice["logprobs"] = None
        return {
            "id": req.request_id,
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
        }

    def _body(self, req: Completion, gen: Generation, extra: dict[str, Any]) -> dict[str, Any]:
        if req.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": gen.text},
                "finish_reason": gen.finish_reason,
            }
        else:
            choice = {
                "index": 0, "text": gen.text, "logprobs": None,
                "finish_reason": gen.finish_reason,
            }  # fmt: skip
        return {
            "id": req.request_id,
            "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(req, gen),
            "tandem": extra,
        }

    def _tandem(
        self, req: Completion, info: PrefillInfo, gen: Generation, ttft_s: float
    ) -> dict[str, Any]:
        return {
            "request_id": req.request_id,
            "prefill": info.where,
            "prefill_node": info.node,
            "prefill_tokens": info.tokens,
            "prefill_s": info.seconds,
            "kv_bytes": info.kv_bytes,
            "ttft_s": ttft_s,
            "decode_tokens": gen.tokens,
            "decode_s": gen.decode_s,
            "decode_tok_s": gen.steady_tok_s,
        }


def _trim_to(caches: list[Any], k: int) -> None:
    """Drop whatever a failed remote prefill left beyond position k."""
    for c in caches:
        if c.offset > k:
            c.trim(c.offset - k)


class _TokenTicker:
    """`first_token`, then `token` events at most ten a second (called on the mlx thread)."""

    def __init__(self, events: EventBus, rid: str) -> None:
        self.events, self.rid = events, rid
        self.last = 0.0

    def tick(self, count: int) -> None:
        if count == 1:
            self.events.publish(RequestEvent(self.rid, phase="first_token", tokens=1))
        now = time.monotonic()
        if now - self.last >= 0.1:
            self.last = now
            self.events.publish(TokenEvent(self.rid, count=count))

    def flush(self, total: int) -> None:
        self.events.publish(TokenEvent(self.rid, count=total))


def _usage(req: Completion, gen: Generation) -> dict[str, int]:
    n = len(req.tokens)
    return {"prompt_tokens": n, "completion_tokens": gen.tokens, "total_tokens": n + gen.tokens}


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}]")
    return float(value)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "request body too large", "request_too_large") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    return body


async def _sse(response: web.StreamResponse, obj: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
