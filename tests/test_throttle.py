"""`--net-gbps`: the paced sender holds a body to the emulated link's rate, within the body too.

The sender runs on its own thread and event loop (`paced_server`), as it does in the prefill
node's process: its precise waits block its own loop, never the receiver's, and between
pieces it lets the rest of its own loop run."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from tandem.app.cli.bare_stream import paced_server
from tandem.nodes.serve.throttle import PacedSender


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


class _Sink:
    """Stands in for the response: `write` returns at once, as aiohttp's does while the
    socket takes the bytes (it never yields to the loop then)."""

    def __init__(self) -> None:
        self.got = bytearray()

    async def write(self, data: bytes | memoryview) -> None:
        self.got += data


def test_pacing_a_frame_lets_the_rest_of_the_loop_run() -> None:
    """The prefill node's loop also takes the device thread's next layer while a frame goes
    out: a sender that paces without yielding holds the next layer's hand-over (and so the
    compute) until the frame is done, and the link idles for a layer's compute every frame."""

    async def run() -> tuple[int, bytes, float]:
        sink, ticks = _Sink(), 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        await PacedSender(0.08).send(sink, bytes(range(256)) * 4000)  # type: ignore[arg-type]
        seconds = time.perf_counter() - t0
        ticker.cancel()
        return ticks, bytes(sink.got), seconds

    ticks, got, seconds = asyncio.run(run())  # 1 MB at 10 MB/s: 0.1 s, 100 pieces
    assert got == bytes(range(256)) * 4000 and seconds >= 0.09
    assert ticks >= 0.5 * seconds / 0.005, (ticks, seconds)
