"""The link a KV stream crosses: its sockets' settings, and how a frame's transfer is timed.

A KV stream is a frame per layer, each sent at once after that layer's compute, over a LAN
(sub-millisecond round trips, no loss). Both ends set these; so does the plain transfer
`tandem bench e2e` compares the stream with.

- Buffers of 4 MiB a side (the kernel doubles them), so that a whole frame is in flight at
  once. Autotuning starts a receive window at 128 KiB and grows it with the traffic, and a
  stream's connection is new for each request.
- Reno congestion control on the sender: it sends a burst at once, and its window grows until
  a loss. BBR, a common default, paces each burst at its bandwidth estimate, which trails the
  link after every compute gap: on loopback here it stretched a 2 MB frame to twice its
  transfer time or more. CUBIC's HyStart can end slow start at the first sign of queueing;
  here it fell between the two.

All best effort: a setting the system refuses is left as it is.
"""

from __future__ import annotations

import contextlib
import socket

BUFFER_BYTES = 4 * 2**20


def tune_sender(sock: socket.socket | None) -> None:
    """The sending end (the prefill node's side of a `/v1/prefill` response)."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
    if hasattr(socket, "TCP_CONGESTION"):  # Linux
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")


def tune_receiver(sock: socket.socket) -> None:
    """The receiving end, before it connects: the window scale is fixed at the handshake."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)


def receiver_socket(addr_info: tuple) -> socket.socket:
    """A receiving socket for `addr_info` (aiohttp's `TCPConnector(socket_factory=...)`)."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    tune_receiver(sock)
    return sock


def arrival_seconds(size: int, seconds: float, later: int) -> float:
    """How long `size` bytes take at the rate a frame's bytes arrived: `later` bytes in the
    `seconds` after its first read. The first read's bytes don't count: a reader sees when
    they are there, not when they began to arrive. (`tandem bench e2e` times its
    plain transfer the same way.)"""
    return size * seconds / later if later > 0 else seconds
