"""Joining a decode group safely: `mx.distributed.init`, then every rank proves to every other
that it holds the cluster token, over the group's own collectives, never sending it.

mlx's ring backend authenticates nothing: rank r accepts the first connection to its port as
its left neighbour. A stranger that connects there first (held open, or sending garbage) takes
that place (issue 47). So after `init` the ranks run two `all_sum`s, each rank filling its own
row of an otherwise zero array (x + 0 is x: the sum is every row, exactly):

1. a nonce of its own with a digest of it: rows whose digests do not match, or a sum that
   never comes (`PROOF_TIMEOUT_S`), mean the ring is not sound (`RingUnsound`);
2. HMAC-SHA256(token, rank, every nonce): a row that does not match, over a ring that was
   sound, is a rank with another token, and the group fails closed (`GroupError`).

An unsound ring is started again (`join`): a failed `init` in this process (mlx caches only a
group that started), an `init` that started with a stranger by starting this process over
(`os.execv`: mlx keeps that group for the process's life), until `START_S` have passed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from tandem.nodes.decode.group.pipeline import GroupError

log = logging.getLogger(__name__)

PROOF_TIMEOUT_S = 10.0  # a proof's sums come within this over a sound ring
START_S = 60.0  # how long a group tries to start before it says why it cannot
RETRY_PAUSE_S = 1.0  # between tries
DEADLINE_ENV = "TANDEM_GROUP_DEADLINE"  # the first try's deadline (time.time()), across execs
_NONCE = 8  # int32 words of a rank's nonce (31 random bits each)
_DIGEST = 4  # int32 words of its digest
_PROOF = 8  # int32 words of its HMAC (31 bits each)
_LABEL = b"tandem decode group v1"

AllSum = Callable[[mx.array], mx.array]


class RingUnsound(Exception):
    """The group's collectives do not carry what the ranks sent: a stranger in the ring, a
    rank that failed to start, or a sum that never came."""


def _words(raw: bytes, n: int) -> list[int]:
    """`n` int32 words of 31 bits each from `raw` (an int32 sum of zeros and one value each
    cannot overflow)."""
    return [int.from_bytes(raw[4 * i : 4 * i + 4], "big") & 0x7FFFFFFF for i in range(n)]


def _digest(nonce: list[int]) -> list[int]:
    return _words(hashlib.sha256(_LABEL + repr(nonce).encode()).digest(), _DIGEST)


def _proof(key: bytes, rank: int, nonces: list[list[int]]) -> list[int]:
    message = _LABEL + f"|{rank}|{nonces}".encode()
    return _words(hmac.new(key, message, hashlib.sha256).digest(), _PROOF)


def _mine(rank: int, size: int, row: list[int]) -> mx.array:
    rows = [[0] * len(row) for _ in range(size)]
    rows[rank] = row
    return mx.array(rows, dtype=mx.int32)


def prove(all_sum: AllSum, rank: int, size: int, token: str | None) -> None:
    """Both rounds on this rank (every rank runs them together). RingUnsound where the ring
    does not carry what was sent; GroupError where a rank holds another token."""
    nonce = [secrets.randbits(31) for _ in range(_NONCE)]
    rows = all_sum(_mine(rank, size, nonce + _digest(nonce))).tolist()
    if len(rows) != size or any(row[_NONCE:] != _digest(row[:_NONCE]) for row in rows):
        raise RingUnsound("the ring carried something no rank sent")
    nonces = [row[:_NONCE] for row in rows]
    key = (token or "").encode()
    proofs = all_sum(_mine(rank, size, _proof(key, rank, nonces))).tolist()
    for r, got in enumerate(proofs):
        if r != rank and not hmac.compare_digest(repr(got), repr(_proof(key, r, nonces))):
            raise GroupError(
                f"rank {r} of the decode group does not hold this rank's cluster token (its "
                "proof over the ring does not match): give every rank the same --token-file "
                "or TANDEM_TOKEN"
            )


def timed_all_sum(group: Any, timeout_s: float = PROOF_TIMEOUT_S) -> AllSum:
    """`all_sum` over `group` that raises RingUnsound when no sum comes within `timeout_s`
    (it waits on a thread of its own: a collective cannot be cancelled, only abandoned)."""

    def all_sum(x: mx.array) -> mx.array:
        got: list[Any] = []

        def run() -> None:
            try:
                out = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
                mx.eval(out)
                got.append(out)
            except Exception as e:  # a peer's connection lost: the ring is not sound
                got.append(e)

        worker = threading.Thread(target=run, name="tandem-group-proof", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if not got:
            raise RingUnsound(f"no answer over the ring in {timeout_s:.0f} s")
        if isinstance(got[0], Exception):
            raise RingUnsound(f"the ring failed ({got[0]})")
        return got[0]

    return all_sum


def join(backend: str, token: str | None) -> Any:
    """The group, proven (`prove`), started again until START_S have passed; GroupError
    saying why when it cannot start, or a rank holds another token."""
    deadline = float(os.environ.get(DEADLINE_ENV) or time.time() + START_S)
    os.environ[DEADLINE_ENV] = repr(deadline)
    while True:
        try:
            group = mx.distributed.init(backend=backend, strict=True)
        except (RuntimeError, ValueError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _again_or_fail(deadline, why)
            continue
        if group.size() < 2:
            raise GroupError("mlx.launch started a group of one: run the node without it")
        try:
            prove(timed_all_sum(group), group.rank(), group.size(), token)
        except RingUnsound as e:  # mlx keeps this group: only a new process starts another
            _again_or_fail(deadline, str(e))
            _start_over(str(e))
        os.environ.pop(DEADLINE_ENV, None)
        return group


def _again_or_fail(deadline: float, why: str) -> None:
    if time.time() + RETRY_PAUSE_S > deadline:
        raise GroupError(
            f"cannot start the decode group: {why} (after {START_S:.0f} s of tries; another "
            "process may be connecting to the ring's ports: give the group a private link or "
            "a firewall rule, see the README)"
        )
    log.warning("decode group: %s; trying again", why)
    time.sleep(RETRY_PAUSE_S)


def _start_over(why: str) -> None:
    """This process again from its start (same pid, parent, arguments and environment, the
    deadline in it), every descriptor but stdio closed by the exec (mlx's sockets are not
    close-on-exec: the stranger's connection would stay open)."""
    log.warning("decode group: starting this rank over (%s)", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    listed = os.path.isdir("/proc/self/fd")  # Linux; macOS: the usual descriptor range
    for fd in [int(f) for f in os.listdir("/proc/self/fd")] if listed else range(3, 1024):
        if fd > 2:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
