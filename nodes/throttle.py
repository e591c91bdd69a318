"""A paced sender: emulates a slower network link (`--net-gbps`) on one machine.

A body goes out in pieces, each released no earlier than the emulated link would carry it,
so the receiver sees the link's rate within a frame, not only between frames. A piece is a
millisecond of the link (at least 4 KiB): finer pacing would cost a wake-up of the event loop
per few dozen microseconds, and on a busy CPU those wake-ups, not the link, would set the rate.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

PIECE_S = 1e-3  # seconds of the emulated link per piece
MIN_PIECE = 4096  # bytes


class PacedSender:
    def __init__(self, net_gbps: float | None) -> None:
        self.rate = net_gbps * 1e9 / 8 if net_gbps else None  # bytes/s

    async def send(self, response: web.StreamResponse, data: bytes | memoryview) -> None:
        if not self.rate:
            await response.write(data)
            return
        view, t0 = memoryview(data), time.perf_counter()
        piece = max(MIN_PIECE, int(self.rate * PIECE_S))
        for start in range(0, len(view), piece):
            left = start / self.rate - (time.perf_counter() - t0)  # when the link is free
            if left > 0:
                await asyncio.sleep(left)
            await response.write(view[start : start + piece])
        left = len(view) / self.rate - (time.perf_counter() - t0)
        if left > 0:
            await asyncio.sleep(left)
