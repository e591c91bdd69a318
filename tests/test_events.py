"""Event records, the bus and its replay ring, and SSE encoding (DESIGN.md "Events")."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest
from tandem.nodes.contract.events import (
    Event,
    EventBus,
    LayerEvent,
    LinkEvent,
    RequestEvent,
    TokenEvent,
    sse,
)

from tests.records import listen

COMMON_KEYS = {"t", "node", "kind", "request_id"}
KIND_KEYS: dict[str, set[str]] = {
    "layer": {"layer", "state", "slot", "pinned", "bytes"},
    "link": {"name", "bytes", "seconds"},
    "request": {"phase", "tokens", "where"},
    "token": {"count"},
}
SAMPLES: list[Event] = [
    LayerEvent("r1", layer=3, state="computing", slot=1, pinned=True, bytes=4096),
    LinkEvent("r1", name="h2d", bytes=1 << 20, seconds=0.01),
    RequestEvent("r1", phase="prefill_done", tokens=17, where="remote"),
    TokenEvent("r1", count=5),
]


def _published(bus: EventBus, n: int) -> list[Event]:
    return [bus.publish(TokenEvent(f"r{i}", t=float(i + 1), count=i)) for i in range(n)]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_records_are_frozen(event: Event) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.request_id = "other"  # type: ignore[misc]


def test_bus_stamps_time_and_node() -> None:
    bus = EventBus(node_id="node-a")
    before = time.time()
    event = bus.publish(TokenEvent("r1", count=1))
    assert before <= event.t <= time.time()
    assert event.node == "node-a"
    assert event.kind == "token"
    assert bus.replay() == [event]


def test_bus_keeps_given_time_and_node() -> None:
    bus = EventBus(node_id="node-a")
    event = bus.publish(TokenEvent("r1", t=12.5, node="node-b", count=1))
    assert (event.t, event.node) == (12.5, "node-b")


def test_listener_gets_records_until_removed() -> None:
    bus = EventBus(node_id="n")
    got: list[Event] = []
    remove = listen(bus, got.append)
    first = bus.publish(LinkEvent("r1", name="disk", bytes=10, seconds=1.0))
    remove()
    bus.publish(LinkEvent("r1", name="disk", bytes=20, seconds=1.0))
    assert got == [first]
    assert got[0].node == "n"  # listeners see the stamped record
    remove()  # removing twice is harmless


def test_replay_since() -> None:
    bus = EventBus()
    events = _published(bus, 5)
    assert bus.replay() == events
    assert bus.replay(since=2.0) == events[2:]
    assert bus.replay(since=2.5) == events[2:]
    assert bus.replay(since=5.0) == []


def test_ring_is_bounded() -> None:
    bus = EventBus(ring_size=3)
    events = _published(bus, 10)
    assert bus.replay() == events[-3:]
    assert bus.replay(since=0.0) == events[-3:]


async def test_subscribe_replays_then_gets_live_events_from_another_thread() -> None:
    bus = EventBus(node_id="n")
    old = _published(bus, 4)  # t = 1, 2, 3, 4
    stream = bus.subscribe(since=2.0)
    try:
        replayed = [await asyncio.wait_for(anext(stream), 5) for _ in range(2)]
        assert replayed == old[2:]

        live = [TokenEvent("live", count=i) for i in range(3)]

        def produce() -> None:
            for e in live:
                bus.publish(e)

        thread = threading.Thread(target=produce)
        thread.start()
        got = [await asyncio.wait_for(anext(stream), 5) for _ in live]
        thread.join()
        assert [e.count for e in got] == [0, 1, 2]
        assert all(e.request_id == "live" and e.node == "n" and e.t > 4.0 for e in got)
    finally:
        await stream.aclose()


async def test_subscribe_without_since_skips_the_ring() -> None:
    bus = EventBus()
    _published(bus, 3)
    stream = bus.subscribe()
    try:
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the subscriber registers before the next publish
        fresh = bus.publish(TokenEvent("new", count=9))
        assert await asyncio.wait_for(pending, 5) == fresh
    finally:
        await stream.aclose()


async def test_closed_subscriber_no_longer_receives() -> None:
    bus = EventBus()
    stream = bus.subscribe(since=0.0)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    bus.publish(TokenEvent("a"))
    await asyncio.wait_for(pending, 5)
    await stream.aclose()
    assert bus._queues == []  # the departed subscriber's queue is not kept (nor fed)
    bus.publish(TokenEvent("b"))
    assert [e.request_id for e in bus.replay()] == ["a", "b"]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_sse_encoding_has_design_keys(event: Event) -> None:
    stamped = EventBus(node_id="node-x").publish(event)
    raw = sse(stamped)
    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 2  # one data line, then the blank line
    body = json.loads(raw[len(b"data: ") : -2])
    assert COMMON_KEYS | KIND_KEYS[event.kind] <= body.keys()
    assert body["kind"] == event.kind
    assert body["node"] == "node-x"
    assert body["t"] == stamped.t
    for key in KIND_KEYS[event.kind]:
        assert body[key] == getattr(event, key)
