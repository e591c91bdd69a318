"""Issue 52 item 3: the other ranks' layer and link events reach rank 0's bus (the node's
`/v1/events`) with their rank, in order, and every socket closes when the ranks stop; the
`rank` field on the wire (absent for a node of one device)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from tandem.nodes.contract.events import (
    Event,
    EventBus,
    LayerEvent,
    LinkEvent,
    RequestEvent,
    event_from_json,
    sse,
)
from tandem.nodes.prefill.ranks import events
from tandem.nodes.prefill.ranks.events import EventForwarder, EventRelay, relay_events
from tandem.nodes.prefill.ranks.shard import Shard

from tests.conftest import MakeTiny
from tests.test_ranks import ROOT, quarter, ranks_env, torchrun

RID = "chatcmpl-r4nk5"


def _open_sockets() -> int:
    """This process's open descriptors (Linux; elsewhere 0, and the check says nothing)."""
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def _until(what: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "rank events"]


def test_rank_is_on_the_wire_only_beside_rank_0() -> None:
    one = LayerEvent(RID, layer=3, state="loading", bytes=10)
    assert "rank" not in one.to_dict() and "rank" not in LinkEvent(RID).to_dict()
    assert b'"rank"' not in sse(one)
    two = LayerEvent(RID, layer=3, state="loading", rank=1)
    assert two.to_dict()["rank"] == 1
    assert event_from_json(json.loads(json.dumps(two.to_dict()))) == two
    assert event_from_json({**LinkEvent(RID, rank=2).to_dict()}) == LinkEvent(RID, rank=2)
    older = {"kind": "layer", "request_id": RID, "layer": 3, "state": "ready"}  # no rank
    assert event_from_json(older) == LayerEvent(RID, layer=3, state="ready")
    for bad in (-1, "1", 1.0, None, True):
        assert event_from_json({**older, "rank": bad}) is None, bad


def _layers(n: int) -> list[Event]:
    """A rank's pass as its engine publishes it: each layer loading, ready, computing,
    evicted, and its copy's link record."""
    out: list[Event] = []
    for i in range(n):
        out += [LayerEvent(RID, layer=i, state="loading", bytes=1000 + i),
                LinkEvent(RID, name="h2d", bytes=1000 + i, seconds=0.01),
                LayerEvent(RID, layer=i, state="ready"),
                LayerEvent(RID, layer=i, state="computing"),
                LayerEvent(RID, layer=i, state="evicted")]  # fmt: skip
    return out


def test_a_followers_events_reach_rank_0s_bus_in_order_and_the_sockets_close() -> None:
    fds = _open_sockets()
    node = EventBus("node-0")
    got: list[Event] = []
    node.listen(got.append)
    relay = EventRelay(node, ranks=3)
    follower_buses = {1: EventBus(), 2: EventBus()}
    forwarders = {r: EventForwarder(bus, relay.address, relay.secret, r)
                  for r, bus in follower_buses.items()}  # fmt: skip
    sent = {r: _layers(40 + r) for r in follower_buses}
    for r, bus in follower_buses.items():
        bus.publish(RequestEvent(RID, phase="prefill_start"))  # not a layer's: stays there
        for event in sent[r]:
            bus.publish(event)
    node.publish(LayerEvent(RID, layer=0, state="loading"))  # rank 0's own
    _until(lambda: len(got) == 1 + sum(map(len, sent.values())))
    for r in follower_buses:
        mine = [e for e in got if getattr(e, "rank", 0) == r]
        assert [replace(e, t=0.0, node="") for e in mine] == [replace(e, rank=r) for e in sent[r]]
        assert all(e.node == "node-0" and e.t > 0 for e in mine)  # stamped by the node's bus
    assert [e.rank for e in got if isinstance(e, LayerEvent) and e.rank == 0] == [0]
    assert _threads() == ["rank events"]
    for f in forwarders.values():
        f.close()
    relay.close()
    assert _threads() == []
    assert _open_sockets() == fds  # every socket either side opened is closed
    follower_buses[1].publish(LayerEvent(RID, layer=0, state="loading"))  # after close: quiet


def test_only_a_rank_with_the_secret_is_heard() -> None:
    node = EventBus("node-0")
    got: list[Event] = []
    node.listen(got.append)
    relay = EventRelay(node, ranks=2)
    try:
        stranger = socket.create_connection(relay.address)
        line = json.dumps(LayerEvent(RID, layer=1, rank=1).to_dict()).encode()
        stranger.sendall(b'{"secret": "guess", "rank": 1}\n' + line + b"\n")
        assert stranger.recv(1) == b""  # dropped
        stranger.close()
        bus = EventBus()
        forwarder = EventForwarder(bus, relay.address, relay.secret, 1)
        bus.publish(LayerEvent(RID, layer=2, state="computing"))
        _until(lambda: len(got) == 1)
        assert isinstance(got[0], LayerEvent) and (got[0].layer, got[0].rank) == (2, 1)
        forwarder.close()
    finally:
        relay.close()


@dataclass
class FakeCollective:
    """Two ranks' `share` between threads (the control group's broadcast)."""

    rank: int
    shard: Shard
    box: list[Any]
    barrier: threading.Barrier

    def share(self, obj: Any) -> Any:
        if self.rank == 0:
            self.box.append(obj)
        self.barrier.wait(5)
        return self.box[0]

    def lose(self, why: str) -> str:  # the relay's heartbeat (a rank gone or silent)
        return why


def test_relay_events_connects_every_rank_through_the_collective() -> None:
    box: list[Any] = []
    barrier = threading.Barrier(2)
    node, own = EventBus("n"), EventBus()
    got: list[Event] = []
    node.listen(got.append)
    ends: dict[int, Any] = {}

    def rank(r: int, bus: EventBus) -> None:
        ends[r] = relay_events(FakeCollective(r, Shard(r, 2), box, barrier), bus)  # type: ignore[arg-type]

    threads = [threading.Thread(target=rank, args=(r, b)) for r, b in ((0, node), (1, own))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert isinstance(ends[0], EventRelay) and isinstance(ends[1], EventForwarder)
    own.publish(LinkEvent(RID, name="disk", bytes=7, seconds=0.5))
    _until(lambda: len(got) == 1)
    assert got[0] == LinkEvent(RID, t=got[0].t, node="n", name="disk", bytes=7, seconds=0.5,
                               rank=1)  # fmt: skip
    ends[1].close()
    ends[0].close()
    assert _threads() == []


def test_a_follower_without_rank_0_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        address = s.getsockname()[:2]
    bus = EventBus()
    forwarder = EventForwarder(bus, address, "x", 1)  # nobody listens there: it says so
    assert "cannot reach rank 0's events" in caplog.text
    assert bus.publish(LayerEvent(RID, layer=0)).layer == 0  # and its bus goes on
    forwarder.close()


def test_two_ranks_under_torchrun_tell_rank_0s_bus(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """Through `ranked_engine`, as a node builds its ranks: rank 1's pass reaches rank 0's
    bus with rank 1, each layer's records in order; the relay's thread is gone at the end."""
    model = tiny_model(arch="llama", layers=4, intermediate=256)
    cmd = torchrun(2, str(ROOT / "tests" / "rank_events_run.py"), str(tmp_path), str(model),
                   str(quarter(model)))  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=ranks_env(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stdout.decode()[-3000:] + done.stderr.decode()[-3000:]
    saved = json.loads((tmp_path / "events.json").read_text())
    assert saved["threads"] == []
    events = [event_from_json(r) for r in saved["events"]]
    by_rank = {r: [e for e in events if getattr(e, "rank", None) == r] for r in (0, 1)}
    assert all(e is not None and e.node == "node-0" for e in events)
    for rank, mine in by_rank.items():
        layers = [e for e in mine if isinstance(e, LayerEvent)]
        assert {e.layer for e in layers if e.state == "computing"} == {0, 1, 2, 3}, rank
        for i in range(4):  # each layer's records in the order its rank went through them
            states = [e.state for e in layers if e.layer == i]
            assert states[0] == "queued" and "computing" in states, states
            if "loading" in states:
                assert states.index("loading") < states.index("ready") < states.index("evicted")
        assert any(isinstance(e, LinkEvent) and e.name == "h2d" for e in mine), rank
    assert not any(e.state == "sent" for e in by_rank[1] if isinstance(e, LayerEvent))


def test_a_rank_gone_or_silent_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connections are the heartbeat: one that closes is a rank gone; one silent past
    the timeout (its beats stopped, as a frozen process's) is a rank not answering."""
    monkeypatch.setattr(events, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(events, "HEARTBEAT_TIMEOUT_S", 0.5)
    lost: list[str] = []
    relay = EventRelay(EventBus("node-0"), ranks=3, on_lost=lost.append)
    one = EventForwarder(EventBus(), relay.address, relay.secret, 1)
    two = EventForwarder(EventBus(), relay.address, relay.secret, 2)
    try:
        time.sleep(1.0)  # beating: nothing lost
        assert lost == []
        one.close()
        _until(lambda: bool(lost))
        assert lost == ["prefill rank 1 is gone (its connection closed)"]
        two._stop.set()  # frozen: its connection open, no beat
        _until(lambda: len(lost) == 2, 5.0)
        assert lost[1].startswith("prefill rank 2 is not answering")
    finally:
        two.close()
        relay.close()
