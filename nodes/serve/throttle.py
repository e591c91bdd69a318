"""A paced sender: emulates a slower network link (`--net-gbps`) on one machine.

A body goes out in pieces, each released when the emulated link would have delivered it, so
the receiver sees the link's rate within a frame, not only between frames. A piece is a
millisecond of the link (at least 4 KiB): finer pacing would cost a wake-up of the event loop
per few dozen microseconds, and on a busy CPU those wake-ups, not the link, would set the rate.

The event loop's timers wake up on whole milliseconds (epoll), up to a millisecond late, which
at 10 Gbit is most of a frame; so the loop sleeps to within `SPIN_S` of each release and the
rest is a precise (blocking) `time.sleep`.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from tandem.nodes.contract.units import gbps_to_Bps

PIECE_S = 1e-3  # seconds of the emulated link per piece
MIN_PIECE = 4096  # bytes
SPIN_S = 1.1e-3  # the last stretch of a wait, slept precisely (the loop waits that long at most)


async def _wait_until(t: float) -> None:
    """Return at perf_counter() ≈ t: the loop's timer for the bulk, time.sleep for the rest.

    It always yields to the loop first: a frame is many pieces, and a sender that never
    yields while it paces one holds up everything else on the loop for the whole frame — the
    device thread's hand-over of the next layer included, which then waits for the link."""
    left = t - time.perf_counter()
    await asyncio.sleep(max(0.0, left - SPIN_S))
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


class PacedSender:
    def __init__(self, net_gbps: float | None) -> None:
        self.rate = gbps_to_Bps(net_gbps) if net_gbps else None  # bytes/s

    async def send(self, response: web.StreamResponse, data: bytes | memoryview) -> None:
        if not self.rate:
            await response.write(data)
            return
        view, t0 = memoryview(data), time.perf_counter()
        piece = max(MIN_PIECE, int(self.rate * PIECE_S))
        # each piece goes out when the link would have delivered its last byte, after a
        # small first piece (a link's first packet): the body's first byte arrives at once,
        # its last at len / rate, and no stretch of it faster than the link
        starts = [0, *range(min(MIN_PIECE, len(view)), len(view), piece)]
        for start, end in zip(starts, [*starts[1:], len(view)], strict=True):
            await _wait_until(t0 + end / self.rate)
            await response.write(view[start:end])
