"""The layer pipeline of recent requests, built from `layer`, `link` and `request` events.

Pure state, no Textual: the pipeline widget draws it and tests read it. A request's layers
carry their state history in arrival order, and the prefill node's times make the timeline
of the request: per layer, when its weights were copied, when it computed, when its K/V was
sent — which shows whether copy or compute bounds the prefill.

A prefill node of several devices (issue 52) tells each rank's copies and computes (`rank` ≥ 1
on its layer events): the timeline then has a copy and a compute lane per rank. A layer's
state, residency and K/V are rank 0's, which serves.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tandem.nodes.contract.events import Event, LayerEvent, LinkEvent, RequestEvent, TokenEvent

PIPE_STATES = ("queued", "loading", "ready", "computing", "sent", "received")
_DONE = {"sent": 4, "received": 5}  # a finished layer never goes back in the display
ROWS = ("copy", "compute", "send")
MAX_LAYERS = 4096  # more than any model has; bounds what a confused node can make us draw
MAX_RANKS = 16  # more devices than a prefill box has; as above
Span = tuple[int, float, float]  # (layer, start, end) in the prefill node's epoch seconds


@dataclass(frozen=True)
class Step:
    """One state a layer went through: where and when (node clock), and when we saw it."""

    state: str
    node: str
    t: float
    seen: float  # local time.monotonic() when the record arrived
    rank: int = 0  # the prefill node's rank it happened on


@dataclass
class LayerTrack:
    layer: int
    state: str = "queued"
    pinned: bool = False
    history: list[Step] = field(default_factory=list)
    send_s: float = 0.0  # seconds the K/V frame took on the wire
    kv_bytes: int = 0  # its K/V frame as the prefill node sent it (else as decode got it)
    experts: tuple[int, int] | None = None  # a mixture of experts: (read, of all) ("routed")
    experts_bytes: int = 0  # the chosen experts' bytes streamed, every rank's (0: resident)
    routed_bytes: dict[int, int] = field(default_factory=dict)  # ... by rank

    def states(self, node: str | None = None) -> list[str]:
        """States in arrival order, of one node or all."""
        return [s.state for s in self.history if node is None or s.node == node]

    def spans(self, rank: int = 0) -> dict[str, list[tuple[float, float]]]:
        """Copy, compute and send intervals on the prefill node (its clock only), of one of
        its ranks (only rank 0 sends).

        A streamed layer may come in several loads (attention, MLP, slices): each is
        `loading → ready`, computes once it is ready and the previous load is done, and is
        `evicted` when computed. A resident layer computes from `computing` to its send.
        """
        out: dict[str, list[tuple[float, float]]] = {row: [] for row in ROWS}
        ready: list[float] = []
        evicted: list[float] = []
        loading: float | None = None
        computing: float | None = None
        for step in self.history:
            if step.rank != rank:
                continue
            if step.state == "loading":
                loading = step.t
            elif step.state == "ready":
                ready.append(step.t)
                if loading is not None:
                    out["copy"].append((loading, step.t))
                    loading = None
            elif step.state == "computing" and computing is None:
                computing = step.t
            elif step.state == "evicted" and computing is not None:
                evicted.append(step.t)
            elif step.state == "sent":
                out["send"].append((step.t - self.send_s, step.t))
        if computing is None:
            return out
        if not evicted:
            end = out["send"][0][0] if out["send"] else computing
            out["compute"].append((computing, max(computing, end)))
        # ready times of loads computed after `computing`: the last len(evicted) of them
        ready = ready[-len(evicted) :] if evicted else []
        start = computing
        for k, end in enumerate(evicted):
            if k:
                start = max(evicted[k - 1], ready[k] if k < len(ready) else evicted[k - 1])
            out["compute"].append((start, max(start, end)))
        return out


@dataclass(frozen=True)
class Timeline:
    """Busy intervals of copy, compute and send over one request, and which bounds it."""

    t0: float
    t1: float
    rows: dict[str, list[Span]]
    busy: dict[str, float]

    @property
    def wall(self) -> float:
        return max(0.0, self.t1 - self.t0)

    @property
    def bound(self) -> str:
        """The busiest of copy and compute, on the busiest rank ('' when nothing ran)."""
        if not any(self.busy.values()):
            return ""
        return max(("copy", "compute"), key=self.busiest)

    def busiest(self, row: str) -> float:
        """A row's busy time: its lane's, or its busiest rank's."""
        return max(busy for lane, busy in self.busy.items() if lane.split()[0] == row)


@dataclass
class RequestTrack:
    request_id: str
    layers: dict[int, LayerTrack] = field(default_factory=dict)
    where: str = ""  # "remote" or "local" once a prefill started
    phase: str = ""
    prefill_node: str = ""
    kv_dtype: str = ""  # how its KV was held, from prefill_start's "kv …" detail: "F32", "q8/g64"
    pending_send_s: float = 0.0  # from the net_out record that precedes each `sent`
    tokens: int = 0  # decoded so far (`token` records)
    ranks: int = 1  # the prefill node's ranks its layer events came from (highest + 1)

    @property
    def in_flight(self) -> bool:
        return self.phase not in ("done", "failed", "cancelled")

    @property
    def layers_sent(self) -> int:
        return sum(layer.state in ("sent", "received") for layer in self.layers.values())

    def layer(self, i: int) -> LayerTrack:
        if i not in self.layers:
            self.layers[i] = LayerTrack(i)
        return self.layers[i]

    @property
    def n_layers(self) -> int:
        return max(self.layers, default=-1) + 1

    def timeline(self, ranks: int = 1) -> Timeline | None:
        """Its lanes (`lanes`) for at least `ranks` ranks (a node's `/health` says how many
        before the other ranks' records arrive); None before anything ran."""
        n = min(MAX_RANKS, max(ranks, self.ranks))
        rows: dict[str, list[Span]] = {lane: [] for lane in lanes(n)}
        for i in sorted(self.layers):
            for rank in range(n):
                for row, spans in self.layers[i].spans(rank).items():
                    if spans:  # a rank's lane is named `row rank`; one "send", rank 0's
                        lane = row if n == 1 or row == "send" else f"{row} {rank}"
                        rows[lane].extend((i, a, b) for a, b in spans)
        spans = [s for row in rows.values() for s in row]
        if not spans:
            return None
        t0 = min(a for _, a, _ in spans)
        t1 = max(b for _, _, b in spans)
        busy = {lane: _union([(a, b) for _, a, b in rows[lane]]) for lane in rows}
        return Timeline(t0, t1, rows, busy)


def lanes(ranks: int) -> tuple[str, ...]:
    """The timeline's rows: copy, compute and send; with several ranks a copy and a compute
    lane per rank ("copy 0", "compute 0", "copy 1", ...), then the send."""
    if ranks <= 1:
        return ROWS
    return (*(f"{row} {r}" for r in range(ranks) for row in ("copy", "compute")), "send")


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class PipelineModel:
    """Recent requests by id; `current` is the one that moved last."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.requests: OrderedDict[str, RequestTrack] = OrderedDict()
        self.current_id: str | None = None

    @property
    def current(self) -> RequestTrack | None:
        return self.requests.get(self.current_id) if self.current_id else None

    def others_in_flight(self) -> list[RequestTrack]:
        """Requests besides the current one still prefilling or decoding, newest first."""
        return [r for rid, r in reversed(self.requests.items())
                if rid != self.current_id and r.in_flight and r.phase]  # fmt: skip

    def track(self, request_id: str) -> RequestTrack:
        if request_id not in self.requests:
            self.requests[request_id] = RequestTrack(request_id)
            while len(self.requests) > self.keep:
                self.requests.popitem(last=False)
        return self.requests[request_id]

    def apply(self, event: Event, seen: float | None = None) -> bool:
        """Fold one event in; True when the picture changed. A layer number no model has is
        ignored: a node's numbers are not ours."""
        if not event.request_id:
            return False
        if isinstance(event, LayerEvent):
            return self._layer(event, time.monotonic() if seen is None else seen)
        if isinstance(event, LinkEvent) and event.name == "net_out":
            self.track(event.request_id).pending_send_s = event.seconds
        elif isinstance(event, TokenEvent):
            req = self.track(event.request_id)
            changed, req.tokens = req.tokens != event.count, max(req.tokens, event.count)
            return changed
        elif isinstance(event, RequestEvent):
            return self._request(event)
        return False

    def _layer(self, e: LayerEvent, seen: float) -> bool:
        if not 0 <= e.layer < MAX_LAYERS or not 0 <= e.rank < MAX_RANKS:
            return False
        step = Step(e.state, e.node, e.t, seen, e.rank)
        req = self.track(e.request_id)
        self.current_id = e.request_id
        layer = req.layer(e.layer)
        if e.state == "routed" and 0 <= e.experts <= e.experts_total:  # every rank's bytes
            layer.routed_bytes[e.rank] = e.bytes
            layer.experts = (e.experts, e.experts_total)
            layer.experts_bytes = sum(layer.routed_bytes.values())
        if e.rank:  # another rank's copy or compute: its lanes only
            layer.history.append(step)
            req.ranks = max(req.ranks, e.rank + 1)
            return True
        if e.state == "sent":
            layer.send_s, req.pending_send_s = req.pending_send_s, 0.0
            layer.kv_bytes = e.bytes or layer.kv_bytes
        elif e.state == "received" and not layer.kv_bytes:
            layer.kv_bytes = e.bytes
        layer.history.append(step)
        layer.pinned = layer.pinned or e.pinned
        if e.state in ("loading", "computing"):
            req.prefill_node = e.node
            req.where = req.where or "remote"
        if e.state in PIPE_STATES and _DONE.get(layer.state, 0) <= _DONE.get(e.state, 0):
            layer.state = e.state
        return True

    def _request(self, e: RequestEvent) -> bool:
        req = self.track(e.request_id)
        req.phase = e.phase
        if e.phase == "prefill_start":
            self.current_id = e.request_id
            req.where = "local" if e.where == "local" else "remote"
            if e.detail.startswith("kv "):  # any client's request, not only the dashboard's
                req.kv_dtype = e.detail[3:][:24]
        return True
