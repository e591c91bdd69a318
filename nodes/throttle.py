"""A paced sender: emulates a slower network link (`--net-gbps`) on one machine.

A body goes out in pieces, each released no earlier than the emulated link would carry it,
so the receiver sees the link's rate within a frame, not only between frames.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

MAX_PIECE = 64 * 1024  # bytes


class PacedSender:
    def __init__(self, net_gbps: float | None) -> None:
        self.rate = net_gbps * 1e9 / 8 if net_gbps else None  # bytes/s

    async def send(self, response: web.StreamResponse, data: bytes | memoryview) -> None:
        if not self.rate:
            await response.write(data)
            return
        view, t0 = memoryview(data), time.perf_counter()
        piece = max(4096, min(MAX_PIECE, len(view) // 8))
        for start in range(0, len(view), piece):
            left = start / self.rate - (time.perf_counter() - t0)  # when the link is free
            if left > 0:
                await asyncio.sleep(left)
            await response.write(view[start : start + piece])
        left = len(view) / self.rate - (time.perf_counter() - t0)
        if left > 0:
            await asyncio.sleep(left)
