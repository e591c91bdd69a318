"""A decode group's start against strangers (issue 47 item 2): mlx's ring takes the first
connection to a rank's port as its neighbour, so a connection held there (or sending garbage)
made both ranks exit. The ranks now prove the cluster token to each other over the ring and
start again until they can: the group starts, or says in one line why not."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import MakeTiny
from tests.group_support import rank_pids, start_group, stop_ranks
from tests.nodeproc import stop_all, wait_healthy
from tests.test_turns import TOKEN

pytestmark = pytest.mark.timeout(240)


def test_a_stranger_on_rank_0s_ring_port_does_not_keep_the_group_from_starting(
    tiny_model: MakeTiny, tmp_path: Path
) -> None:
    """A stranger connects to rank 0's ring port as soon as it listens, sends garbage and holds
    the connection; rank 1 starts after. The group still comes up and serves a chat."""
    model = tiny_model(arch="llama", layers=4)
    strangers: list[socket.socket] = []

    def stranger(ring: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                s = socket.create_connection(("127.0.0.1", ring), timeout=1)
            except OSError:
                time.sleep(0.02)
                continue
            s.sendall(b"\xde\xad\xbe\xef" * 64)
            strangers.append(s)  # held open for the whole test
            return
        raise AssertionError("rank 0 never listened on its ring port")

    group = start_group(tmp_path, model, token=TOKEN, between=stranger)
    try:
        wait_healthy(group, timeout=150)
        req = urllib.request.Request(
            group.url + "/v1/chat/completions",
            data=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}',
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert reply["usage"]["completion_tokens"] == 3
        assert "trying again" in group.output() or "starting this rank over" in group.output()
    finally:
        for s in strangers:
            s.close()
        stop_all([group])
        stop_ranks(group)


def test_a_rank_with_another_token_stops_the_group_saying_so(
    tiny_model: MakeTiny, tmp_path: Path
) -> None:
    """Rank 1 holds another token: both ranks exit at once (no model loaded, no retry), each
    with one line naming the rank whose proof did not match."""
    model = tiny_model(arch="llama", layers=4)
    group = start_group(tmp_path, model, token=TOKEN, other_token="not-" + TOKEN)
    try:
        assert group.proc.wait(timeout=60) != 0
        said = group.output()
        assert "rank 1 of the decode group does not hold this rank's cluster token" in said
        assert "Traceback" not in said, said[-2000:]
        deadline = time.monotonic() + 10
        while rank_pids(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not rank_pids(group)
        rank1 = (tmp_path / f"group-{group.port}-rank1.log").read_text()
        assert "rank 0 of the decode group does not hold" in rank1, rank1[-2000:]
    finally:
        with contextlib.suppress(Exception):
            stop_all([group])
        stop_ranks(group)
