"""A reply's token events for the dashboard, from the mlx thread: its first token, then its
count at most ten times a second."""

from __future__ import annotations

import time

from tandem.nodes.contract.events import EventBus, RequestEvent, TokenEvent


class TokenTicker:
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
