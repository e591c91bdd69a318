"""The decode group's proof of the cluster token over its own collectives (issue 47 item 2),
with the collective faked by a barrier between threads (one per rank): the real ring's cases
are in test_decode_group_start.py."""

from __future__ import annotations

import threading
from collections.abc import Callable

import mlx.core as mx
import pytest
from tandem.nodes.decode.group.pipeline import GroupError
from tandem.nodes.decode.group.proof import AllSum, RingUnsound, prove


def ranks(
    tokens: list[str | None], tamper: Callable[[int, mx.array], mx.array] | None = None
) -> list[BaseException | None]:
    """Every rank's `prove` at once over a faked all_sum (`tamper(call, sum)` changes what
    the ring carries); each rank's exception, None where it proved."""
    size = len(tokens)
    lock, barrier = threading.Lock(), threading.Barrier(size)
    parts: list[list[mx.array]] = [[] for _ in range(8)]
    calls = [0] * size

    def all_sum_for(rank: int) -> AllSum:
        def all_sum(x: mx.array) -> mx.array:
            call = calls[rank]
            calls[rank] += 1
            with lock:
                parts[call].append(x)
            barrier.wait(timeout=5)
            total = sum(parts[call][1:], parts[call][0])
            return tamper(call, total) if tamper else total

        return all_sum

    out: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        try:
            prove(all_sum_for(rank), rank, size, tokens[rank])
        except (GroupError, RingUnsound) as e:
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_ranks_with_one_token_prove_it_to_each_other() -> None:
    assert ranks(["s3cret", "s3cret"]) == [None, None]
    assert ranks(["s3cret"] * 3) == [None, None, None]
    assert ranks([None, None]) == [None, None]  # a loopback group without a token


def test_a_rank_with_another_token_fails_closed_naming_it() -> None:
    got = ranks(["s3cret", "other", "s3cret"])
    assert all(isinstance(e, GroupError) for e in got), got
    assert "rank 1 of the decode group does not hold" in str(got[0])
    assert "rank 0 of the decode group does not hold" in str(got[1])
    assert ranks(["s3cret", None])[0] is not None  # a rank without one proves nothing


def test_garbage_on_the_ring_is_an_unsound_ring_not_a_wrong_token() -> None:
    """A stranger's bytes summed in: the nonces' digests do not match, and the ranks start
    the group again rather than blame a token."""

    def garbage(call: int, total: mx.array) -> mx.array:
        return total + 1 if call == 0 else total

    got = ranks(["s3cret", "s3cret"], garbage)
    assert all(isinstance(e, RingUnsound) for e in got), got


def test_a_proof_that_never_names_the_token() -> None:
    """What crosses the ring is nonces, digests and HMACs: never the token's bytes."""
    seen: list[bytes] = []

    def spy(call: int, total: mx.array) -> mx.array:
        seen.append(bytes(memoryview(mx.array(total, dtype=mx.int32))))
        return total

    token = "AAAAAAAAAAAAAAAA"
    assert ranks([token, token], spy) == [None, None]
    assert seen and all(token.encode() not in raw and b"AAAA" not in raw for raw in seen)


@pytest.mark.parametrize("size", [2, 4])
def test_every_rank_sees_every_other_ranks_proof(size: int) -> None:
    got = ranks(["t"] * (size - 1) + ["u"])
    assert all(isinstance(e, GroupError) for e in got)
    assert f"rank {size - 1} of the decode group" in str(got[0])


_RESTARTED = """
import os, socket, sys
from tandem.nodes.decode.group import proof
if os.environ.get("RESTARTED"):
    fd = int(os.environ["RESTARTED"])
    try:
        os.fstat(fd)
        still = True
    except OSError:
        still = False
    print("after", os.getpid(), sys.argv[1:], still, os.environ[proof.DEADLINE_ENV])
    sys.exit(0)
fd = socket.socket().detach()  # a descriptor such as mlx's ring sockets: inherited by exec
os.set_inheritable(fd, True)
os.environ["RESTARTED"] = str(fd)
os.environ[proof.DEADLINE_ENV] = "123.0"
print("before", os.getpid(), flush=True)
proof._start_over("a test")
"""


def test_a_rank_started_over_is_the_same_process_without_its_old_sockets() -> None:
    """An unsound ring whose group mlx keeps: the rank execs itself (same pid, so mlx.launch
    and the parent-death signal still hold; same arguments; the deadline carried), and the
    old connections (a stranger's) close."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _RESTARTED, "--flag", "x"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split("\n")[:2]
    pid = before.split()[1]
    assert after == f"after {pid} ['--flag', 'x'] False 123.0", out.stdout
    assert "starting this rank over (a test)" in out.stderr
