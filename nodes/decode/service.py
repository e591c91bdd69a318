"""The decode node's pipeline for one completion, in order:

1. admission: a bounded number of generations at once and a bounded queue (503 beyond);
2. the prompt cache: a copy of the longest cached prefix of the prompt;
3. the route: local (mlx) or a trusted prefill node (`router.choose`);
4. the prefill: remote through `RemotePrefill` (retried while the node is busy, abandoned the
   moment the peer table marks it unreachable), else — or on any remote failure — local;
5. the generation: the reply joins every other running one on the mlx thread (`Batcher`: one
   batch steps them all); text pieces as they come, then `Finished`.

Every exit publishes one final `request` event: `done`, `cancelled` or `failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from tandem.nodes.cluster.peers import PeerTable
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.contract.cluster import Batching
from tandem.nodes.contract.events import EventBus, RequestEvent
from tandem.nodes.contract.http import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_REMOTE_TIMEOUT_S,
    ApiError,
    KVFormat,
)
from tandem.nodes.decode import lm
from tandem.nodes.decode.batching import Batcher, Cancelled, GroupGone, Join
from tandem.nodes.decode.completion import Finished, GenerationFailed, PrefillInfo
from tandem.nodes.decode.families import family_for
from tandem.nodes.decode.families.base import KVShape, LayerStepper
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.openai_api import Completion, kv_format_in
from tandem.nodes.decode.prompt_cache import PromptCache
from tandem.nodes.decode.remote import PrefillCall, RemotePrefill, RemotePrefillError, RemoteResult
from tandem.nodes.decode.reply import Generation
from tandem.nodes.decode.router import Ahead, LocalRate, Mode, asked, choose
from tandem.nodes.decode.ticker import TokenTicker
from tandem.nodes.model.kv_bytes import kv_bytes
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.serve.metrics import DecodeMetrics

log = logging.getLogger(__name__)
# what steps beside the batch, a step a tick, in each batching mode (`/health`)
UNBATCHED = {
    "continuous": "replies with a quantized KV cache (mlx-lm 0.32's QuantizedKVCache has no "
    "merge): each steps beside the batch",
    "interleaved": "every reply: each takes a step in turn",
}
MAX_ATTEMPTS = 5  # a busy prefill node is asked this many times at most


class DecodeService:
    """Completions on one model: the pipeline above, shared by every route."""

    def __init__(
        self,
        host: ModelHost,
        spec: ModelSpec,
        expect: KVShape,
        fingerprint: str,
        events: EventBus,
        peers: PeerTable,
        mode: Mode = "auto",
        max_tokens_limit: int = 4096,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        max_queue: int = DEFAULT_MAX_QUEUE,
        remote_timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S,
        kv_format: KVFormat | None = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        metrics: DecodeMetrics | None = None,
    ) -> None:
        self.host = host
        self.metrics = DecodeMetrics(spec.name) if metrics is None else metrics  # None: unread
        self.spec = spec
        self.events = events
        self.peers = peers
        self.mode = mode
        self.max_tokens_limit = max_tokens_limit
        self.remote_timeout_s = remote_timeout_s
        self.expect = expect
        # the default of requests that do not say (mlx-lm attends with sinks over floats only)
        self.kv_format = None if spec.float_kv else kv_format
        # a request's bits without a group size take the node's (its own bits may be 16)
        self.kv_group_size = kv_group_size
        self.kv_kernel = lm.device_kernel()  # whose rounding quantized K/V must match
        self.family = family_for(spec.family)  # fills caches from frames, steps the last token
        self.remote = RemotePrefill(host, expect, fingerprint, peers, family=self.family,
                                    kinds=spec.layer_kinds)  # fmt: skip
        self.local = LocalRate()  # measured mlx prefill rate and floor
        self.prompt_cache = PromptCache()
        self.batcher = Batcher(host, on_step=self.metrics.batch_size)  # every reply, one batch
        self.model_name = spec.name
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self._slots = asyncio.Semaphore(max_concurrent)
        self._waiting = 0
        self._in_flight: dict[str, Ahead] = {}  # remote prefills asked of each node, not back

    # ------------------------------------------------------------ calibration

    async def start(self) -> None:
        """Load the model; in a decode group, every reply ends at once when it is lost."""
        await self.host.start()
        if self.host.group is not None:
            self.host.group.on_lost.append(self.batcher.abandon)

    async def calibrate(self, tokens: int = 128) -> LocalRate:
        """Measure this node's local (mlx) prefill rate and floor for the router."""
        floor = await self.host.thread.call(self.host.measure_prefill, 1)
        rate = await self.host.thread.call(self.host.measure_prefill, tokens)
        self.local = LocalRate(tok_s=tokens / rate, floor_s=floor)
        log.info("local prefill: %.0f tokens/s, floor %.1f ms", tokens / rate, floor * 1e3)
        return self.local

    async def probe_peers(self) -> None:
        """Keep calibrating: measure each newly trusted prefill node with a tiny prefill (the
        peer table says when an entry changes)."""
        with self.peers.on_change() as changed:
            while True:
                changed.clear()
                for peer in self.peers.trusted("prefill"):
                    if peer.prefill_floor_s is None:
                        await self._probe(peer.address)
                await changed.wait()

    async def _probe(self, address: str, count: int = 8) -> None:
        caches = await self.host.thread.call(self.host.new_cache)
        tokens = [(5 * i + 1) % self.spec.vocab_size for i in range(count)]
        call = PrefillCall(f"probe-{uuid.uuid4().hex[:8]}", tokens, 0, timeout_s=30.0)
        try:
            result = await self.remote(address, call, caches)  # no events: a probe is quiet
        except RemotePrefillError as e:
            log.info("probe of %s failed: %s", address, e)
            self.peers.update_rates(address, seconds=30.0)
            return
        self.peers.update_rates(address, None, result.link_Bps, result.seconds)
        log.info("prefill node %s: pass floor %.1f ms", address, result.seconds * 1e3)

    # ------------------------------------------------------------ the pipeline

    def refuse_if_lost(self) -> None:
        """503 `group_broken` once a decode group is gone: before anything waits on the mlx
        thread, which a frozen rank's collective may hold for good."""
        if self.host.group is not None and self.host.group.lost is not None:
            raise ApiError(503, self.host.group.lost, "group_broken")

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """A generation slot, after a wait in a bounded queue; 503 when that is full."""
        self.refuse_if_lost()
        if self._slots.locked() and self._waiting >= self.max_queue:
            raise ApiError(
                503, f"{self.max_concurrent} generations running and {self._waiting} waiting",
                "overloaded", {"Retry-After": "1"},
            )  # fmt: skip
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._slots.release()

    async def run(self, req: Completion) -> AsyncIterator[str | Finished]:
        """Text pieces of the reply as they are generated, then one `Finished`.

        Iterate it inside `contextlib.aclosing`: leaving early cancels the generation and
        waits for the mlx thread (and publishes `cancelled`)."""
        rid = req.request_id
        publish = self.events.publish
        publish(RequestEvent(rid, phase="queued", tokens=len(req.tokens)))
        t0 = time.perf_counter()
        try:
            caches, info = await self._prefill(req)
            ticker = TokenTicker(self.events, rid)
            held = lm.positions(caches)  # positions already in the cache
            # a state cannot be cut back: a snapshot at the end of the prompt, for a turn
            # whose history differs from this reply (as a chat template may render it)
            snapshot = partial(self._snapshot, req.tokens) if lm.has_state(caches) else None
            join = Join(req.tokens[held:], caches, req.sampling, ticker.tick, req.kv_format,
                        info.first, snapshot)  # fmt: skip
            async with self.batcher.reply(join) as gen:
                async for text in gen:
                    yield text
            result, caches = gen.result, gen.caches
            assert result is not None and caches is not None
            ticker.flush(result.tokens)
            await self.host.thread.call(self._remember, req.tokens + result.token_ids, caches)
        except (asyncio.CancelledError, GeneratorExit, ConnectionResetError, Cancelled):
            publish(RequestEvent(rid, phase="cancelled", detail="client went away"))
            self.metrics.aborted()
            raise
        except GroupGone as e:  # the group said so (it logged why): no traceback to add
            publish(RequestEvent(rid, phase="failed", detail=str(e)))
            self.metrics.failed()
            raise GenerationFailed(str(e), 503, "group_broken") from e
        except Exception as e:
            log.exception("request %s failed", rid)
            publish(RequestEvent(rid, phase="failed", detail=f"{type(e).__name__}: {e}"))
            self.metrics.failed()
            if self.host.group is not None:  # the ranks are out of step: the group is done
                lost = self.host.group.lose(
                    f"the decode group lost a rank ({type(e).__name__}: {e})"
                )
                raise GenerationFailed(lost, 503, "group_broken") from e
            raise GenerationFailed(f"generation failed: {type(e).__name__}: {e}") from e
        if info.where == "local":
            info.seconds = result.first_token_s
        publish(RequestEvent(rid, phase="done", tokens=result.tokens, where=info.where))
        ttft = (result.first_token_at or time.perf_counter()) - t0
        self.metrics.finished(len(req.tokens), result, info, ttft, time.perf_counter() - t0)
        yield Finished(result, self._tandem(req, info, result, ttft))

    def batching(self) -> Batching:
        """How replies run at once, for `/health`."""
        b = self.batcher
        return Batching(
            b.mode, b.running, self._waiting, self.max_concurrent,
            b.batch_sizes[-1] if b.batch_sizes else 0, UNBATCHED[b.mode],
        )  # fmt: skip

    @property
    def supports_tools(self) -> bool:
        """Whether the model's tokenizer has tool calling (mlx-lm infers it from the chat
        template): `tools` and the `tool` role are then taken, refused otherwise."""
        return bool(getattr(self.host.tokenizer, "has_tool_calling", False))

    def kv_format_in(self, body: Any) -> KVFormat | None:
        """A completion body's KV format, this node's defaults filling what it leaves out;
        ApiError (400) for one it cannot serve."""
        return kv_format_in(body, self.kv_format, self.kv_kernel, self.spec.head_dim,
                            self.kv_group_size, float_only=self.spec.float_kv)  # fmt: skip

    def _remember(self, tokens: list[int], caches: lm.Caches) -> None:
        """On the mlx thread: keep this conversation's KV for its next turn."""
        if lm.positions(caches) <= len(tokens):
            self.prompt_cache.store(tokens[: lm.positions(caches)], caches)

    def _snapshot(self, tokens: list[int], caches: lm.Caches) -> None:
        """On the mlx thread: keep a copy of caches that hold the prompt but its last token."""
        n = lm.positions(caches)
        self.prompt_cache.store(tokens[:n], lm.clone_prefix(caches, n))

    def _prepare(
        self, tokens: list[int], fmt: KVFormat | None
    ) -> tuple[int, lm.Caches, LayerStepper | None, bool]:
        """On the mlx thread, in one hop: caches holding the longest cached prefix 0..k-1 of
        `tokens` (new caches where none is cached), the last token's layer-at-a-time pass
        over them (used by a remote prefill; None where the family has none), and whether the
        prompt cache fell back to an earlier point (a window it could not cut back)."""
        fallbacks = self.prompt_cache.fallbacks  # lookups run on this thread alone
        k, reused = self.prompt_cache.lookup(tokens, fmt)
        caches = reused if reused is not None else self.host.new_cache()
        lm.keep_for_restore(caches)  # what a failed remote prefill goes back to
        fell_back = self.prompt_cache.fallbacks != fallbacks
        return k, caches, self.family.stepper(self.host.model, tokens[-1], caches), fell_back

    def _restore(
        self, caches: lm.Caches, before: lm.Caches, k: int, last: int
    ) -> LayerStepper | None:
        """On the mlx thread: the caches as a failed remote prefill found them (each layer's
        own cache object again: a quantized stream replaces a float layer's with a quantized
        copy, whose float original is left as it was), trimmed to their first k positions,
        and a fresh pass of the `last` token over them. A local prefill then runs as mlx-lm's
        would, on float K/V, quantizing after the prompt."""
        lm.restore(caches, before)
        if k == 0:  # nothing to keep: fresh caches (a window's cannot be trimmed once full)
            lm.replace(caches, self.host.new_cache())
        else:
            lm.trim_to(caches, k)
        return self.family.stepper(self.host.model, last, caches)

    async def _prefill(self, req: Completion) -> tuple[lm.Caches, PrefillInfo]:
        """Caches holding positions 0..k-1, k = n-1 after a remote prefill; mlx-lm prefills
        whatever the cache lacks locally. The prompt cache supplies a reused prefix first."""
        rid, n, fmt = req.request_id, len(req.tokens) - 1, req.kv_format
        k, caches, first, fell_back = await self.host.thread.call(self._prepare, req.tokens, fmt)
        reuse = {"cached": k, "cache_fallback": fell_back}
        new = n - k  # positions that need a prefill
        wire = kv_bytes(self.spec, fmt, ITEMSIZE[self.expect.dtype])
        decision = choose(self.mode, new, wire, self.local, self.peers.trusted("prefill"),
                          self._in_flight)  # fmt: skip
        publish = self.events.publish
        if decision.where == "local":
            if self.mode == "always" and new > 0:
                publish(RequestEvent(rid, phase="failed", detail=decision.reason))
            publish(
                RequestEvent(rid, phase="prefill_start", tokens=new, where="local",
                             detail=f"kv {self.expect.held_as(fmt)}")
            )  # fmt: skip
            return caches, PrefillInfo("local", None, new, **reuse)
        peer = decision.peer
        assert peer is not None
        publish(
            RequestEvent(rid, phase="prefill_start", tokens=new, where=peer.address,
                         detail=f"kv {self.expect.held_as(fmt)}")
        )  # fmt: skip
        call = PrefillCall(rid, req.tokens[:-1], k, kv_format=fmt)
        before = list(caches)  # a quantized stream swaps layers' caches for quantized ones
        try:
            with asked(self._in_flight, peer.address, new):
                result, first = await self._remote(peer.address, call, caches, first,
                                                   req.tokens[-1])  # fmt: skip
        except RemotePrefillError as e:
            await self.host.thread.call(self._restore, caches, before, k, req.tokens[-1])
            log.warning("remote prefill failed, prefilling locally: %s", e)
            publish(RequestEvent(rid, phase="failed", detail=str(e), where="remote"))
            return caches, PrefillInfo("local", None, new, **reuse)
        # a pass near the floor says nothing about the marginal rate
        rate = (
            result.compute_tok_s(self.spec.num_layers)
            if result.seconds > 2 * (peer.prefill_floor_s or 0)
            else None
        )
        self.peers.update_rates(peer.address, rate, result.link_Bps, result.seconds)
        publish(RequestEvent(rid, phase="prefill_done", tokens=new, where=peer.address))
        info = PrefillInfo("remote", peer.address, new, result.seconds, result.kv_bytes, **reuse)
        if first is not None and first.complete:
            info.first = first
        elif first is not None:  # not every layer ran: the last token goes through whole
            await self.host.thread.call(lm.trim_to, caches, n)
        return caches, info

    async def _remote(
        self,
        address: str,
        call: PrefillCall,
        caches: lm.Caches,
        first: LayerStepper | None,
        last: int,
    ) -> tuple[RemoteResult, LayerStepper | None]:
        """The remote prefill, asked again (after its Retry-After, with jitter) while the node
        is busy, at most MAX_ATTEMPTS times within the timeout (`RemotePrefill` gives up the
        moment the peer table stops trusting the node). With it, `first`: the pass of the
        prompt's `last` token, a layer at a time as the layers land (a fresh one for each
        attempt)."""
        deadline = time.monotonic() + self.remote_timeout_s
        before = list(caches)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            left = deadline - time.monotonic()
            timed = replace(call, timeout_s=max(1.0, left))
            try:
                return await self.remote(address, timed, caches, self.events, first), first
            except RemotePrefillError as e:
                wait = e.retry_after
                if wait is None or attempt == MAX_ATTEMPTS:
                    raise
                wait *= random.uniform(1.0, 1.5)
                if time.monotonic() + wait >= deadline:
                    raise
                first = await self.host.thread.call(self._restore, caches, before, call.start, last)
                log.info("prefill node busy, asking again in %.1f s", wait)
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def _tandem(
        self, req: Completion, info: PrefillInfo, gen: Generation, ttft_s: float
    ) -> dict[str, Any]:
        return ReplyStats(
            request_id=req.request_id, prefill=info.where, prefill_node=info.node,
            prefill_tokens=info.tokens, prefill_s=info.seconds, kv_bytes=info.kv_bytes,
            ttft_s=ttft_s, decode_tokens=gen.tokens, decode_s=gen.decode_s,
            kv_dtype=self.expect.held_as(req.kv_format), steady_tok_s=gen.steady_tok_s,
            cached_tokens=info.cached, cache_fallback=info.cache_fallback,
        ).to_json()  # fmt: skip
