"""The bare transfer `tandem bench e2e` compares the KV handoff with: the same frames from an
aiohttp server through the same paced sender and socket settings as the prefill node's, read
and timed as the decode node reads and times its KV stream."""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from tandem.nodes.serve import http_stream
from tandem.nodes.serve.kv_link import arrival_seconds, tune_sender
from tandem.nodes.serve.throttle import PacedSender
from tandem.nodes.trust import tls as tls_files

_Started = tuple[asyncio.AbstractEventLoop, asyncio.Event, int]  # the server's loop, stop, port


def _paced_app(bodies: Sequence[bytes], net_gbps: float | None, gap_s: float) -> web.Application:
    """One route, GET or POST: `bodies` through the paced sender, `gap_s` apart."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        if request.transport is not None:
            tune_sender(request.transport.get_extra_info("socket"))  # as the prefill node's
        await resp.prepare(request)
        sender = PacedSender(net_gbps)  # the same emulated link as the prefill node's
        for i, body in enumerate(bodies):
            if i and gap_s:
                await asyncio.sleep(gap_s)
            await sender.send(resp, body)
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    app.router.add_post("/", handler)
    return app


async def _serve(
    app: web.Application,
    identity: tls_files.Identity | None,
    ready: queue.Queue[_Started | BaseException],
) -> None:
    """Serve `app` on a free loopback port until the event put on `ready` is set."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ssl = tls_files.server_context(identity) if identity else None
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl)
        await site.start()
        stop = asyncio.Event()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.put((asyncio.get_running_loop(), stop, port))
        await stop.wait()
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def paced_server(
    bodies: Sequence[bytes],
    net_gbps: float | None,
    gap_s: float = 0.0,
    identity: tls_files.Identity | None = None,
) -> Iterator[str]:
    """An aiohttp server that streams `bodies` through the paced sender, `gap_s` apart (as KV
    frames come a layer's compute apart, each into an idle connection), to a GET or a POST;
    over TLS with `identity`'s certificate; yields its URL.

    It runs on a thread with its own event loop, as the prefill node is a process of its own:
    the sender's precise waits then hold up the sender, not the client timing it."""
    ready: queue.Queue[_Started | BaseException] = queue.Queue()
    app = _paced_app(bodies, net_gbps, gap_s)

    def run() -> None:
        try:
            asyncio.run(_serve(app, identity, ready))
        except BaseException as e:  # surfaced to the caller below
            ready.put(e)

    thread = threading.Thread(target=run, name="paced-server", daemon=True)
    thread.start()
    got = ready.get(timeout=30)
    if isinstance(got, BaseException):
        raise RuntimeError(f"paced server failed: {got}") from got
    loop, stop, port = got
    try:
        yield f"{'https' if identity else 'http'}://127.0.0.1:{port}/"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)


FRAME_GAP_S = 0.02  # between the plain transfer's frames: each starts on an idle connection


async def _frame_rates(url: str, sizes: list[int], pin: str | None = None) -> list[float]:
    """One bare transfer of frames of `sizes` bytes: bytes/s of each, read as the decode node
    reads its KV stream (`http_stream`, each frame into a buffer of its own size) and timed as
    KV frames are (`arrival_seconds`: from the read with a frame's first bytes to the one with
    its last). Where every frame came whole in one read (idle cores, a socket buffer that
    holds a frame), none can be timed so: the whole transfer's rate, from the request to its
    last byte, stands for them (a lower bound)."""
    rates: list[float] = []
    buf = memoryview(bytearray(max(sizes, default=0)))
    t_post = time.perf_counter()
    async with http_stream.post(url, b"{}", {}, read_timeout_s=60, pin=pin) as r:
        for size in sizes:
            got, start, early, now = 0, 0.0, 0, 0.0
            while got < size:
                n = await r.read_into(buf[got:size])
                if not n:
                    raise RuntimeError(f"the bare transfer ended {size - got} bytes early")
                now = time.perf_counter()
                if not got:  # a frame's first bytes
                    start, early = now, n
                got += n
            seconds = arrival_seconds(size, now - start, size - early)
            if seconds > 0:
                rates.append(size / seconds)
    whole_s = time.perf_counter() - t_post
    return rates or ([sum(sizes) / whole_s] if sizes and whole_s > 0 else [])


async def raw_transfer(
    sizes: list[int],
    net_gbps: float | None,
    start_load: Callable[[], Coroutine[Any, Any, object]],
    tls: bool,
) -> dict[str, float]:
    """Bare streams of the same frames: bytes/s while `start_load()` runs (the cluster serving
    one more remote prefill: the load the KV frames were sent under), plain (`raw_Bps`) and
    with `tls` also over TLS (`raw_tls_Bps`), taken in turns under that load; and plain with
    idle cores (`raw_idle_Bps`)."""
    frames = [bytes(n) for n in sizes]
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(paced_server(frames, net_gbps, FRAME_GAP_S))
        urls: dict[str, tuple[str, str | None]] = {"raw_Bps": (plain, None)}  # (url, pin)
        if tls:
            certs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-e2e-")))
            identity = tls_files.load_or_create(certs, "bench")
            url = stack.enter_context(paced_server(frames, net_gbps, FRAME_GAP_S, identity))
            urls["raw_tls_Bps"] = (url, identity.fingerprint)
        idle = await _frame_rates(plain, sizes)
        load = asyncio.create_task(start_load())
        loaded: dict[str, list[float]] = {name: [] for name in urls}
        try:
            while not load.done() or not all(loaded.values()):
                for name, (url, pin) in urls.items():
                    loaded[name] += await _frame_rates(url, sizes, pin)
            await load
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
    out = {name: statistics.median(rates or [math.inf]) for name, rates in loaded.items()}
    return out | {"raw_idle_Bps": statistics.median(idle or [math.inf])}
