"""Rank 0's orders to the other ranks of a decode group, over `mx.distributed` itself.

An order is a JSON object (its op, its arguments, small integer arrays such as a step's
tokens inline, the other arrays' name, dtype and shape), zero-padded to `HEAD_BYTES`, then
those arrays, each sent as an `all_sum` to which only rank 0 adds anything (exact: x + 0 is
x): one collective for a decode step's order. Every rank takes part in every order, in the
same sequence, so the ring backend (which talks to neighbours only) serves any group size.

A doorbell: mlx's ring backend polls while it waits in a collective (a core busy for as long
as a rank is idle), so the other ranks wait for each order on a socket to rank 0 instead, one
byte per order, and enter the collectives only then. The socket also says when rank 0 is gone
(the ranks exit) or a rank is (rank 0 sees the bell fail), and carries each other rank's
heartbeat back (`heartbeat`: one byte a second from a thread of its own, which a collective
never blocks): a rank that is frozen (SIGSTOP, a hung machine) stops beating, and rank 0 knows
within HEARTBEAT_TIMEOUT_S even while it waits in a collective that rank never joins.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

BELL_TIMEOUT_S = 30.0  # the other ranks connect within this, once the group is up
HEARTBEAT_S = 1.0  # each other rank beats this often on its bell
HEARTBEAT_TIMEOUT_S = 5.0  # a rank silent this long is frozen: the group is lost
_TOKEN = 8  # int32s of the bell's secret


HEAD_BYTES = 1024  # an order's JSON head, zero-padded: one all_sum for most orders
INLINE_MAX = 64  # integer arrays of at most this many values travel in the head (tokens)


def _small(a: mx.array) -> bool:
    return a.size <= INLINE_MAX and a.dtype in (mx.int32, mx.uint32, mx.int64)


def _padded(raw: bytes, n: int) -> mx.array:
    return mx.array(list(raw) + [0] * (n - len(raw)), dtype=mx.uint8)


def _unpadded(x: mx.array) -> dict[str, Any]:
    return json.loads(bytes(x.tolist()).rstrip(b"\0"))


class GroupLost(ConnectionError):
    """A rank of the group is gone (its doorbell socket closed)."""


Args = Mapping[str, Any]  # an order's arguments (its JSON head)
Arrays = Mapping[str, mx.array]  # an order's arrays, by name


@dataclass(frozen=True)
class Order:
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, mx.array] = field(default_factory=dict)


def _name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # "mlx.core.float32" -> "float32"


def _dtype(name: str) -> Any:
    dtype = getattr(mx, name, None)
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"an order names dtype {name!r}")
    return dtype


class Channel:
    """Rank 0 `send`s, the others `receive`, in lockstep (`open_channel` makes one)."""

    def __init__(self, group: Any, bells: list[socket.socket]) -> None:
        self.group, self.rank, self.bells = group, group.rank(), bells

    def _all_sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def send(
        self, op: str, args: Args | None = None, arrays: Arrays | None = None, to: int | None = None
    ) -> None:
        """On rank 0: one order to every other rank; its arrays only to rank `to` where that
        is a neighbour in the ring (point to point, half the bytes of an all_sum)."""
        for bell in self.bells:
            try:
                bell.sendall(b"!")
            except OSError as e:
                raise GroupLost(f"a rank of the decode group is gone ({e})") from None
        arrays = dict(arrays or {})
        inline = {n: a.tolist() for n, a in arrays.items() if _small(a)}  # in the head itself
        listed = [[n, _name(a.dtype), list(a.shape)] for n, a in arrays.items() if n not in inline]
        small = {n: [_name(arrays[n].dtype), v] for n, v in inline.items()}
        size = self.group.size()
        to = to if to in (1, size - 1) else None  # the ring sends to neighbours only
        head = {"op": op, "args": dict(args or {}), "arrays": listed, "inline": small, "to": to}
        raw = json.dumps(head).encode()
        if len(raw) > HEAD_BYTES:  # a long head: its length first, then it
            self._all_sum(_padded(json.dumps({"long": len(raw)}).encode(), HEAD_BYTES))
            self._all_sum(_padded(raw, len(raw)))
        else:
            self._all_sum(_padded(raw, HEAD_BYTES))
        for n, a in arrays.items():
            if n in inline:
                continue
            if to is None:
                self._all_sum(a)
            else:
                mx.eval(mx.distributed.send(a, to, group=self.group, stream=mx.cpu))

    def receive(self) -> Order:
        """On any other rank: the next order (asleep on the bell until there is one)."""
        if self.bells[0].recv(1) != b"!":
            raise GroupLost("rank 0 of the decode group is gone")
        head = _unpadded(self._all_sum(mx.zeros((HEAD_BYTES,), dtype=mx.uint8)))
        if "long" in head:
            head = _unpadded(self._all_sum(mx.zeros((head["long"],), dtype=mx.uint8)))
        arrays = {n: mx.array(v, dtype=_dtype(d)) for n, (d, v) in head["inline"].items()}
        to = head.get("to")
        for name, dtype, shape in head["arrays"]:
            if to is None:
                arrays[name] = self._all_sum(mx.zeros(tuple(shape), dtype=_dtype(dtype)))
            elif to == self.rank:
                got = mx.distributed.recv(tuple(shape), _dtype(dtype), 0, group=self.group,
                                          stream=mx.cpu)  # fmt: skip
                mx.eval(got)
                arrays[name] = got
        return Order(head["op"], head["args"], arrays)

    def heartbeat(self, stop: threading.Event) -> None:
        """On another rank, on a thread of its own until `stop`: a beat to rank 0 every
        HEARTBEAT_S (its bell's other direction: rank 0 reads nothing else there)."""
        while not stop.wait(HEARTBEAT_S):
            try:
                self.bells[0].sendall(b".")
            except OSError:
                return  # rank 0 is gone: `receive` says so

    def close(self) -> None:
        for bell in self.bells:
            bell.close()


def open_channel(group: Any) -> Channel:
    """Every rank at once: rank 0 listens on its own host, tells the others its port and a
    secret (an `all_sum`), and takes one connection from each other rank that knows it."""
    rank, size = group.rank(), group.size()
    listener = None
    mine = mx.zeros((1 + _TOKEN,), dtype=mx.int32)
    if rank == 0:
        listener = socket.create_server((_rank0_host(), 0))
        listener.settimeout(BELL_TIMEOUT_S)
        secret = [secrets.randbits(31) for _ in range(_TOKEN)]
        mine = mx.array([listener.getsockname()[1], *secret], dtype=mx.int32)
    told = mx.distributed.all_sum(mine, group=group, stream=mx.cpu).tolist()
    port, secret = told[0], bytes(json.dumps(told[1:]), "ascii")
    if listener is None:
        bell = socket.create_connection((_rank0_host(), port), timeout=BELL_TIMEOUT_S)
        bell.sendall(secret)
        bell.settimeout(None)
        return Channel(group, [bell])
    bells: list[socket.socket] = []
    with listener:
        while len(bells) < size - 1:
            conn, _ = listener.accept()
            conn.settimeout(BELL_TIMEOUT_S)
            if _read(conn, len(secret)) == secret:
                conn.settimeout(None)
                bells.append(conn)
            else:
                conn.close()  # not one of the group
    return Channel(group, bells)


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    try:
        while len(data) < n and (chunk := conn.recv(n - len(data))):
            data += chunk
    except OSError:
        return b""
    return data


def _rank0_host() -> str:
    """Rank 0's address as `mlx.launch` gave it: the JACCL coordinator's, the ring hostfile's
    first entry, else loopback."""
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    try:
        entries = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())
        return str(entries[0][0]).rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, TypeError, IndexError):
        return "127.0.0.1"
