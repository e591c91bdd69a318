"""Throughput over time from `link` and `token` events: bytes (or tokens) per bucket.

Pure state, no Textual. Records are binned by the time they arrive here, so clocks of
different machines never need to agree.

Host→device bytes are counted once. A CUDA prefill node publishes each load's copy as it is
queued (`h2d`, its bytes, 0 seconds: the copy is timed by CUDA events only once the request
is done) and then the pass's copies again as one `h2d` event with their seconds
(nodes/prefill/engine.py); that closing event repeats bytes already counted. A CPU node's
per-load events carry their own seconds and no closing event follows.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tandem.nodes.contract.events import Event, LinkEvent, TokenEvent

LINKS = ("disk", "h2d", "net_out", "net_in")
SERIES = (*LINKS, "tokens")
BUCKET_S = 0.5
KEEP = 240  # buckets: two minutes at 0.5 s


class RateSeries:
    """Amount per second in consecutive buckets; `peak` is the highest completed bucket."""

    def __init__(self, bucket_s: float = BUCKET_S, keep: int = KEEP) -> None:
        self.bucket_s = bucket_s
        self.values: deque[float] = deque(maxlen=keep)  # per second
        self.peak = 0.0
        self._acc = 0.0
        self._start: float | None = None

    def add(self, amount: float, now: float) -> None:
        self.roll(now)
        self._acc += amount

    def roll(self, now: float) -> None:
        """Close every bucket that ended before `now`."""
        if self._start is None:  # buckets of every series share their boundaries
            self._start = math.floor(now / self.bucket_s) * self.bucket_s
        while now >= self._start + self.bucket_s:
            rate = self._acc / self.bucket_s
            self.values.append(rate)
            self.peak = max(self.peak, rate)
            self._acc = 0.0
            self._start += self.bucket_s

    @property
    def current(self) -> float:
        return self.values[-1] if self.values else 0.0


@dataclass
class Bandwidth:
    """One series per link plus decode tokens/s."""

    series: dict[str, RateSeries]

    @classmethod
    def empty(cls, bucket_s: float = BUCKET_S) -> Bandwidth:
        return cls({name: RateSeries(bucket_s) for name in SERIES})

    def __post_init__(self) -> None:
        self._token_counts: dict[str, int] = {}
        # per request and rank (a prefill node's device): bytes of untimed (CUDA) copies
        self._untimed_h2d: dict[tuple[str, int], int] = {}

    def apply(self, event: Event, now: float) -> bool:
        """Fold one event in; True when it moved a series."""
        if isinstance(event, LinkEvent) and event.name in LINKS:
            if event.name == "h2d" and self._repeats_copies(event):
                return False
            self.series[event.name].add(float(event.bytes), now)
            return True
        if isinstance(event, TokenEvent):
            rid, count = event.request_id, event.count
            before = self._token_counts.get(rid, 0)
            self._token_counts[rid] = max(before, count)
            if len(self._token_counts) > 64:
                self._token_counts.pop(next(iter(self._token_counts)))
            self.series["tokens"].add(max(0, count - before), now)
            return True
        return False

    def _repeats_copies(self, event: LinkEvent) -> bool:
        """Whether an `h2d` event is a CUDA pass's closing one: timed, after untimed per-load
        copies of the same request on the same rank that add up to its bytes (then not counted
        again)."""
        key = (event.request_id, event.rank)
        if event.seconds == 0:
            self._untimed_h2d[key] = self._untimed_h2d.get(key, 0) + event.bytes
            if len(self._untimed_h2d) > 64:
                self._untimed_h2d.pop(next(iter(self._untimed_h2d)))
            return False
        if self._untimed_h2d.get(key) == event.bytes:
            del self._untimed_h2d[key]  # the request's next pass counts afresh
            return True
        return False

    def roll(self, now: float) -> None:
        for s in self.series.values():
            s.roll(now)
