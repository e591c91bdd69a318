"""Event records, an in-process bus with a replay ring, and SSE encoding (DESIGN.md "Events").

Producers may run on any thread (the prefill device thread, the mlx thread); `publish` is
thread-safe. Async subscribers get records through their event loop; `?since=T` replays
from the ring first. A listener (`listen`: the node's metrics) gets every record at once, on
the publishing thread, and loses none.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, get_args

from tandem.nodes.contract.http import sse_encode

LayerStage = Literal[
    "queued", "loading", "ready", "computing", "sent", "received", "evicted", "routed"
]
LinkName = Literal["disk", "h2d", "net_out", "net_in"]
RequestPhase = Literal[
    "queued", "prefill_start", "prefill_done", "first_token", "done", "failed", "cancelled"
]


@dataclass(frozen=True)
class Event:
    """Common fields; `t` and `node` are stamped by the bus when left empty."""

    request_id: str
    t: float = 0.0
    node: str = ""
    kind: str = ""

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        if out.get("rank") == 0:  # a node of one device says no rank (as before ranks)
            del out["rank"]
        return out


@dataclass(frozen=True)
class LayerEvent(Event):
    layer: int = 0
    state: LayerStage = "queued"
    slot: int | None = None
    pinned: bool = False
    bytes: int = 0
    experts: int = 0  # "routed": the experts its tokens chose (a mixture of experts' layer)
    experts_total: int = 0  # ... out of its experts
    rank: int = 0  # the prefill node's rank (device) it happened on (prefill/ranks/)
    kind: str = "layer"


@dataclass(frozen=True)
class LinkEvent(Event):
    name: LinkName = "disk"
    bytes: int = 0
    seconds: float = 0.0
    rank: int = 0  # the prefill node's rank (device) whose link it was (prefill/ranks/)
    kind: str = "link"


@dataclass(frozen=True)
class RequestEvent(Event):
    phase: RequestPhase = "queued"
    tokens: int = 0
    where: str = ""
    detail: str = ""
    kind: str = "request"


@dataclass(frozen=True)
class TokenEvent(Event):
    count: int = 0
    kind: str = "token"


@dataclass(frozen=True)
class ReadingEvent(Event):
    """A node's gauges as a new reading lands (no request: `request_id` ""): `source` "gpu"
    (the card's own counters, NVML) or "mlx_memory", `values` as `/health` carries them
    (nodes/contract/gauges.py)."""

    source: str = "gpu"
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    kind: str = "reading"


_KINDS: dict[str, type[Event]] = {
    "layer": LayerEvent, "link": LinkEvent, "request": RequestEvent, "token": TokenEvent,
    "reading": ReadingEvent,
}  # fmt: skip


def event_from_json(obj: object) -> Event | None:
    """The typed event of one `/v1/events` record; None for a kind or shape not known here
    (a newer node's, or a value of the wrong type), so a reader skips what it cannot read.
    Keys not known here are ignored; a missing one takes its default (a layer's or link's
    `rank`: 0, as a node of one device, or an older one, leaves it out)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("request_id"), str):
        return None
    cls = _KINDS.get(str(obj.get("kind")))
    if cls is None:
        return None
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            value = _typed(obj[f.name], str(f.type))
            if value is _BAD:
                return None
            values[f.name] = value
    if isinstance(rank := values.get("rank", 0), int) and rank < 0:  # a rank counts from 0
        return None
    return cls(**values)


_BAD = object()
_LITERALS: dict[str, tuple[str, ...]] = {
    "LayerStage": get_args(LayerStage), "LinkName": get_args(LinkName),
    "RequestPhase": get_args(RequestPhase),
}  # fmt: skip


def _typed(value: object, kind: str) -> object:
    """`value` as a field of type `kind` (the annotation's text) holds it, else `_BAD`."""
    if kind == "int | None" and value is None:
        return None
    if kind in ("int", "int | None"):
        return value if type(value) is int else _BAD
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            return _BAD
        return float(value)
    if kind == "bool":
        return value if isinstance(value, bool) else _BAD
    if kind == "str":
        return value if isinstance(value, str) else _BAD
    if kind == "dict[str, float]":  # gauges: finite numbers by name, others left out
        if not isinstance(value, dict):
            return _BAD
        return {k: float(v) for k, v in value.items() if isinstance(k, str) and _finite(v)}
    return value if value in _LITERALS[kind] else _BAD


def _finite(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)


class EventBus:
    """Fan-out of one node's events, with a bounded ring for late subscribers."""

    def __init__(self, node_id: str = "", ring_size: int = 4096) -> None:
        self.node_id = node_id
        self._ring: collections.deque[Event] = collections.deque(maxlen=ring_size)
        self._lock = threading.Lock()
        self._queues: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]]] = []
        self._listeners: tuple[Callable[[Event], None], ...] = ()

    def publish(self, event: Event) -> Event:
        """Stamp, remember and deliver one record. Safe from any thread."""
        event = dataclasses.replace(
            event, t=event.t or time.time(), node=event.node or self.node_id
        )
        with self._lock:
            self._ring.append(event)
            queues = list(self._queues)
        for listener in self._listeners:
            listener(event)
        for loop, queue in queues:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_offer, queue, event)
        return event

    def listen(self, listener: Callable[[Event], None]) -> None:
        """Call `listener` with every record from now on, stamped, on the publishing thread
        (a device thread too): it must be quick, thread-safe and never raise."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def replay(self, since: float | None = None) -> list[Event]:
        """Records in the ring newer than `since` (all of them when None)."""
        with self._lock:
            return [e for e in self._ring if since is None or e.t > since]

    async def subscribe(self, since: float | None = None) -> AsyncIterator[Event]:
        """Replayed records newer than `since` (none when None), then live ones, forever."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=10_000)
        with self._lock:
            backlog = [e for e in self._ring if since is not None and e.t > since]
            self._queues.append((loop, queue))
        try:
            for event in backlog:
                yield event
            while True:
                yield await queue.get()
        finally:
            with self._lock:
                self._queues.remove((loop, queue))


def _offer(queue: asyncio.Queue[Event], event: Event) -> None:
    # A subscriber that cannot keep up loses its oldest records rather than the node's memory.
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(event)


def sse(event: Event) -> bytes:
    """One Server-Sent Events record of the event."""
    return sse_encode(event.to_dict())
