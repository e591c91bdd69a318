"""`--net-gbps`: the paced sender holds a body to the emulated link's rate, within the body too."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from nodes.throttle import PacedSender


async def _timed_transfer(net_gbps: float | None, body: bytes) -> tuple[float, float, bytes]:
    """(seconds to the last byte, seconds to the first half, the bytes) over real loopback."""
    sender = PacedSender(net_gbps)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await sender.send(resp, body)
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    got, half_at = bytearray(), None
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as r:
            t0 = time.perf_counter()
            async for chunk in r.content.iter_any():
                got += chunk
                if half_at is None and len(got) >= len(body) // 2:
                    half_at = time.perf_counter() - t0
            total = time.perf_counter() - t0
    finally:
        await runner.cleanup()
    assert half_at is not None
    return total, half_at, bytes(got)


def test_paced_body_takes_the_links_time_and_arrives_intact() -> None:
    body = bytes(range(256)) * 800  # 200 KiB
    total, half, got = asyncio.run(_timed_transfer(0.04, body))  # 5 MB/s: 41 ms
    assert got == body
    assert total >= 0.9 * len(body) / 5e6
    assert half >= 0.3 * total  # paced within the body, not one burst and then a wait


def test_unthrottled_is_a_plain_write() -> None:
    body = b"x" * 100_000
    total, _, got = asyncio.run(_timed_transfer(None, body))
    assert got == body and total < 1.0
