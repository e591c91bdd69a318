"""What the tests read from real nodes' replies, through the contract's records (the
parsers the TUI and the nodes use): a completion's `tandem` stats, a `/v1/cluster` entry, a
`/v1/events` record."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.contract.cluster import Cluster, Peer
from tandem.nodes.contract.events import Event, EventBus, event_from_json


def stats_of(reply: Any) -> ReplyStats:
    """The `tandem` stats of an OpenAI client's reply or chunk (`model_extra["tandem"]`) or
    of a completion's JSON body (`["tandem"]`)."""
    body = reply if isinstance(reply, dict) else reply.model_extra
    return ReplyStats.from_json(body["tandem"])


def peer_at(cluster: Cluster, address: str) -> Peer | None:
    """`cluster`'s entry for `address`, if listed (a relay and the node it relays to share an
    id; only their addresses tell them apart)."""
    return next((p for p in cluster.peers if p.address == address), None)


def event_of(line: bytes) -> Event | None:
    """The event of one `/v1/events` SSE line (`data: {...}`); None for any other line."""
    if not line.startswith(b"data: "):
        return None
    return event_from_json(json.loads(line[6:]))


def listen(bus: EventBus, listener: Callable[[Event], None]) -> Callable[[], None]:
    """Call `listener` with each record `bus` publishes, stamped, on the publishing thread the
    moment it is published (the nodes read a bus through `subscribe`; a test that times or
    orders records as they are made wraps `publish`). Returns what stops it."""
    publish = bus.publish

    def publishing(event: Event) -> Event:
        stamped = publish(event)
        listener(stamped)
        return stamped

    bus.publish = publishing  # type: ignore[method-assign]

    def stop() -> None:
        if bus.__dict__.get("publish") is publishing:
            bus.publish = publish  # type: ignore[method-assign]

    return stop
