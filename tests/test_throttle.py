"""`--net-gbps`: the paced sender holds a body to the emulated link's rate, within the body too.

The sender runs on its own thread and event loop (`paced_server`), as it does in the prefill
node's process: its precise waits block its own loop, never the receiver's."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from app.bench_e2e import paced_server


async def _timed_get(url: str, size: int) -> tuple[float, float, bytes]:
    """(seconds to the last byte, seconds to the first half, the bytes) from the first byte."""
    got, t0, half_at = bytearray(), None, None
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        async for chunk in r.content.iter_any():
            t0 = t0 or time.perf_counter()
            got += chunk
            if half_at is None and len(got) >= size // 2:
                half_at = time.perf_counter() - t0
    assert t0 is not None and half_at is not None
    return time.perf_counter() - t0, half_at, bytes(got)


def _transfer(net_gbps: float | None, body: bytes) -> tuple[float, float, bytes]:
    with paced_server([body], net_gbps) as url:
        return asyncio.run(_timed_get(url, len(body)))


def test_paced_body_takes_the_links_time_and_arrives_intact() -> None:
    body = bytes(range(256)) * 800  # 200 KiB
    total, half, got = _transfer(0.04, body)  # 5 MB/s: 41 ms, 5 KB pieces
    assert got == body
    assert total >= 0.85 * len(body) / 5e6
    assert half >= 0.3 * total  # paced within the body, not one burst and then a wait


def test_paced_frames_at_10_gbit_keep_the_rate_on_average() -> None:
    """Millisecond pieces at 10 Gbit: the rate holds, neither faster (no burst) nor far slower
    (no millisecond-late timer per piece)."""
    frames = [bytes(2 * 2**20)] * 5  # 10 MiB: 8.4 ms at 1.25 GB/s
    with paced_server(frames, 10.0) as url:
        seconds, _, got = asyncio.run(_timed_get(url, sum(map(len, frames))))
    nominal = len(got) / 1.25e9
    assert len(got) == sum(map(len, frames))
    assert 0.8 * nominal <= seconds < 5 * nominal


def test_unthrottled_is_a_plain_write() -> None:
    body = b"x" * 100_000
    total, _, got = _transfer(None, body)
    assert got == body and total < 1.0
