"""The other ranks' layer and link events on rank 0's bus, live (issue 52): the dashboard draws
every card's copy and compute lanes.

Every rank's engine publishes its passes' `LayerEvent`s and `LinkEvent`s on its own bus; only
rank 0's is the node's (`/v1/events`). Once the engines are built (`relay_events`, after
`Collective.describe`), rank 0 opens a loopback TCP listener (`EventRelay`) and tells the
others its address and a secret over the control group; each other rank connects
(`EventForwarder`) and sends every such event of its bus, with its rank, as one JSON line: the
`/v1/events` record, read back by the contract's one parser (`event_from_json`). One thread on
rank 0 publishes them on the node's bus, each rank's in the order it sent them.

A stream, not datagrams: a pass's `queued` burst (every layer of every request) must not be
dropped while rank 0's thread waits for the GIL, and loopback buffers hold megabytes. The ranks
are processes of one machine (`torchrun --nproc-per-node`), so loopback reaches them all.

Both ends close with the ranks (`Collective.close`): rank 0's thread ends and closes every
socket it opened; a follower's connection closes.

The connections are the ranks' heartbeat too: each follower beats every `HEARTBEAT_S`, so a
rank whose connection closes (it died) or that goes silent for `HEARTBEAT_TIMEOUT_S` (frozen)
is lost at once (`on_lost`: `Collective.lose`), even while no pass runs.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from tandem.nodes.contract.events import Event, EventBus, LayerEvent, LinkEvent, event_from_json

if TYPE_CHECKING:
    from tandem.nodes.prefill.ranks.collective import Collective

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
READ_BYTES = 1 << 16
MAX_LINE = 1 << 20  # bytes: a record is a few hundred; a connection sending more is dropped
SEND_TIMEOUT_S = 5.0  # a follower whose send waits this long stops forwarding (rank 0 is stuck)
HEARTBEAT_S = 1.0  # a follower's beat
HEARTBEAT_TIMEOUT_S = 5.0  # a rank silent this long is frozen
BEAT = b'{"beat":1}'


@dataclass
class _Conn:
    """One follower's connection on rank 0: its unread bytes; its rank once it said hello."""

    buf: bytes = b""
    rank: int | None = None


class EventRelay:
    """Rank 0: the other ranks' layer and link events, published on the node's `bus` by one
    thread (`rank events`) until `close`."""

    def __init__(
        self, bus: EventBus, ranks: int, on_lost: Callable[[str], object] | None = None
    ) -> None:
        self.bus, self.on_lost = bus, on_lost
        self._heard: dict[int, float] = {}  # a connected rank's last line (monotonic)
        self.secret = secrets.token_hex(16)  # a local process that is not a rank sends nothing
        self._server = socket.create_server((LOOPBACK, 0))
        host, port = self._server.getsockname()[:2]
        self.address: tuple[str, int] = (str(host), int(port))
        self._wake, self._waker = socket.socketpair()  # `close` wakes the thread through it
        self._waiting = set(range(1, ranks))  # the ranks not connected yet
        self._thread = threading.Thread(target=self._run, name="rank events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """End the thread; every socket it opened is closed when this returns."""
        if self._thread.is_alive():
            self._waker.send(b"\0")
            self._thread.join()
        for sock in (self._server, self._wake, self._waker):
            sock.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake, selectors.EVENT_READ)
        sel.register(self._server, selectors.EVENT_READ)
        conns: dict[socket.socket, _Conn] = {}
        try:
            while True:
                for key, _ in sel.select(HEARTBEAT_S / 2):
                    sock = cast(socket.socket, key.fileobj)
                    if sock is self._wake:
                        return
                    if sock is self._server:
                        conn, _ = sock.accept()
                        conns[conn] = _Conn()
                        sel.register(conn, selectors.EVENT_READ)
                    elif not self._read(sock, conns[sock]):
                        sel.unregister(sock)
                        sock.close()
                        gone = conns.pop(sock).rank
                        if gone is not None:
                            self._lost(f"prefill rank {gone} is gone (its connection closed)")
                now = time.monotonic()
                silent = [
                    (r, now - t) for r, t in self._heard.items() if now - t > HEARTBEAT_TIMEOUT_S
                ]
                if silent:
                    self._lost(f"prefill rank {silent[0][0]} is not answering (silent for "
                               f"{silent[0][1]:.0f} s)")  # fmt: skip
                if not self._waiting and self._server.fileno() != -1:  # every rank is in
                    sel.unregister(self._server)
                    self._server.close()
        finally:
            for conn in conns:
                conn.close()
            sel.close()

    def _read(self, sock: socket.socket, conn: _Conn) -> bool:
        """What `sock` has, published line by line; False once it is closed (or misbehaves)."""
        try:
            data = sock.recv(READ_BYTES)
        except OSError:
            return False
        if not data:
            return False
        *lines, conn.buf = (conn.buf + data).split(b"\n")
        if len(conn.buf) > MAX_LINE:
            log.warning("rank events: a line over %d bytes; the connection is dropped", MAX_LINE)
            return False
        if conn.rank is not None:
            self._heard[conn.rank] = time.monotonic()
        for line in lines:
            if conn.rank is not None:
                if line != BEAT:
                    self._publish(line, conn.rank)
            elif (rank := self._hello(line)) is not None:
                conn.rank = rank
                self._heard[rank] = time.monotonic()
            else:
                return False
        return True

    def _hello(self, line: bytes) -> int | None:
        """A connection's first line: the relay's secret and the rank it speaks for."""
        obj = _json(line)
        if not isinstance(obj, dict) or not isinstance(obj.get("secret"), str):
            return None
        rank = obj.get("rank")
        if (
            not hmac.compare_digest(obj["secret"].encode(), self.secret.encode())
            or type(rank) is not int
            or rank not in self._waiting
        ):
            log.warning("rank events: a connection that is not a rank's is dropped")
            return None
        self._waiting.discard(rank)
        return rank

    def _lost(self, why: str) -> None:
        """A rank is gone or frozen: said once; the ranks are broken from now on."""
        self._heard.clear()
        if self.on_lost is not None:
            self.on_lost(why)

    def _publish(self, line: bytes, rank: int) -> None:
        event = event_from_json(_json(line))
        if isinstance(event, LayerEvent | LinkEvent):  # its connection's rank; stamped here
            self.bus.publish(dataclasses.replace(event, rank=rank, node=""))
        else:
            log.debug("rank events: rank %d sent a record this node does not relay", rank)


class EventForwarder:
    """A rank other than 0: every layer and link event of its engine's bus, with its rank, to
    rank 0's `EventRelay` (on the publishing thread: a JSON line into a loopback buffer)."""

    def __init__(self, bus: EventBus, address: tuple[str, int], secret: str, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.create_connection(address, timeout=SEND_TIMEOUT_S)
        except OSError as e:  # the node serves on; the dashboard misses this rank's lanes
            log.warning("rank %d: cannot reach rank 0's events at %s (%s)", rank, address, e)
        self._send({"secret": secret, "rank": rank})
        bus.listen(self.forward)
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="rank beats", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        """Every `HEARTBEAT_S`: this rank is alive (rank 0 loses a silent one)."""
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                if self._sock is None:
                    return
                try:
                    self._sock.sendall(BEAT + b"\n")
                except OSError:
                    return

    def forward(self, event: Event) -> None:
        """The bus's listener: a layer or link event on to rank 0, with this rank."""
        if isinstance(event, LayerEvent | LinkEvent):
            self._send(dataclasses.replace(event, rank=self.rank, node="").to_dict())

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _send(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(line)
            except OSError as e:  # rank 0 is gone or stuck: the ranks' collectives will say so
                log.warning("rank %d: its events no longer reach rank 0 (%s)", self.rank, e)
                self._sock.close()
                self._sock = None


def relay_events(c: Collective, bus: EventBus) -> EventRelay | EventForwarder:
    """On every rank once its engine is built (a collective: all call it): rank 0's relay onto
    `bus`, the node's; the others' forwarders from `bus`, their engines'. `Collective.close`
    closes it (`Collective.relay`)."""
    if c.rank != 0:
        address, secret = c.share(None)
        return EventForwarder(bus, (address[0], address[1]), secret, c.rank)
    relay = EventRelay(bus, c.shard.world, c.lose)
    try:
        c.share((relay.address, relay.secret))
    except BaseException:
        relay.close()
        raise
    return relay


def _json(line: bytes) -> object:
    try:
        return json.loads(line)
    except ValueError:
        return None
