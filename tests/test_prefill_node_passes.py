"""A prefill node serving many at once (issue 46): a reader that stops reading (a Mac asleep
mid-transfer froze the prefill node for every other client) is dropped once it has taken none
of a frame for `--stall-timeout`, and the request queued behind it is served, the node's
`/health` showing its queue meanwhile (what a decode node's router counts); prompts queued
during a pass share the next one, each as its lone run."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.cluster import PrefillQueue
from tandem.nodes.contract.events import RequestEvent
from tandem.nodes.contract.frames import LayerFrame
from tandem.nodes.model import fingerprint, load_index

from tests.bad_input_support import events_since
from tests.conftest import MakeTiny
from tests.nodeproc import NodeProc, start_node, stop_all
from tests.records import event_of
from tests.test_wire import decode_all

TOKEN = "stalled-reader-token-0123456789"
STALL_S = 2.0
# 4 layers of K and V for 1500 tokens, 8 KV heads of 64, float32: 6 MB a layer, far more
# than loopback's socket buffers hold for a reader that takes nothing
MODEL = {"arch": "llama", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8}
LONG = 1500


@pytest.fixture(scope="module")
def node(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    tmp = tmp_path_factory.mktemp("stall")
    n = start_node(tmp, tiny_model(**MODEL), "prefill", "--stall-timeout", str(STALL_S),
                   token=TOKEN)  # fmt: skip
    yield n
    stop_all([n])


def _body(model: Path, rid: str, count: int) -> bytes:
    tokens = [(7 * i + 3) % 500 for i in range(count)]
    return json.dumps(PrefillBody(fingerprint(load_index(model)), rid, tokens).to_json()).encode()


def _frames(node: NodeProc, body: bytes) -> list[LayerFrame]:
    req = urllib.request.Request(
        node.url + "/v1/prefill", data=body, method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return [f for f in decode_all(r.read()) if isinstance(f, LayerFrame)]


def test_a_reader_that_stops_reading_loses_its_stream_and_holds_up_nobody(
    node: NodeProc, tiny_model: MakeTiny
) -> None:
    model = tiny_model(**MODEL)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
    stalled.connect(("127.0.0.1", node.port))
    body = _body(model, "asleep", LONG)
    stalled.sendall(
        b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )  # and then reads nothing
    try:
        time.sleep(0.5)  # it holds the device when the next one arrives
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            awake = pool.submit(_frames, node, _body(model, "awake", 40))
            # meanwhile the node's /health shows the one it serves and the one waiting
            queue = None
            while time.monotonic() - t0 < STALL_S and not awake.done():
                queue = node.health().queue
                if queue is not None and queue.waiting:
                    break
                time.sleep(0.05)
            assert queue == PrefillQueue(1, tokens_waiting=40, running_tokens=LONG, running=1)
            frames = awake.result()
        waited = time.monotonic() - t0
        assert [f.layer for f in frames] == list(range(MODEL["layers"]))
        # the device never waits on a reader: the next pass starts once the last computed
        # (its compute, not the stall, bounds the wait; generous for a loaded machine)
        assert waited < STALL_S + 20, f"the next request waited {waited:.1f} s"
        time.sleep(STALL_S + 1.0)  # still reading nothing: its stream is dropped meanwhile
        stalled.settimeout(10)
        got = 0
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            while chunk := stalled.recv(1 << 20):
                got += len(chunk)
        whole = MODEL["layers"] * 2 * MODEL["kv_heads"] * LONG * 64 * 4
        assert got < whole, "the stalled stream was finished, not dropped"
    finally:
        stalled.close()
    req = urllib.request.Request(f"{node.url}/v1/events?since=0")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    failed = []
    try:
        with urllib.request.urlopen(req, timeout=1.0) as r:
            for line in r:
                e = event_of(line)
                if isinstance(e, RequestEvent) and e.request_id == "asleep" and e.phase == "failed":
                    failed.append(e.detail)
    except TimeoutError:
        pass
    assert failed and "took none of layer" in failed[0], failed


@pytest.fixture(scope="module")
def slow_node(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    """A prefill node whose weights stream through a quarter of them at 10 MB/s (a pass takes
    about a second and a half), without a prefix cache (each run computes its own)."""
    model = tiny_model(**MODEL)
    index = load_index(model)
    budget = sum(index.layer_bytes(i) for i in range(MODEL["layers"])) // 4
    tmp = tmp_path_factory.mktemp("passes")
    n = start_node(tmp, model, "prefill", "--budget", str(budget), "--link-gbps", "0.08",
                   "--host-budget", "0", "--prefix-cache", "0", token=TOKEN)  # fmt: skip
    yield n
    stop_all([n])


def test_prompts_queued_during_a_pass_share_the_next_one_each_as_its_lone_run(
    slow_node: NodeProc, tiny_model: MakeTiny
) -> None:
    """Issue 46: four prefills that arrive while a pass runs wait for the next, which serves
    all four with one stream of the weights; each one's frames are its lone run's."""
    model = tiny_model(**MODEL)
    lengths = (30, 7, 52, 18)
    bodies = [_body(model, f"four-{i}", n) for i, n in enumerate(lengths)]
    since = time.time()
    with ThreadPoolExecutor(5) as pool:
        blocker = pool.submit(_frames, slow_node, _body(model, "blocker", 20))
        t0 = time.monotonic()
        while slow_node.health().queue.running == 0:  # type: ignore[union-attr]
            assert time.monotonic() - t0 < 10
            time.sleep(0.02)
        together = list(pool.map(lambda b: _frames(slow_node, b), bodies))
        blocker.result()
    starts = {
        e.request_id: e.detail
        for e in events_since(slow_node, since, token=TOKEN)
        if isinstance(e, RequestEvent) and e.phase == "prefill_start"
    }
    assert starts.get("blocker") == "pass of 1", starts
    assert all(starts[f"four-{i}"] == "pass of 4" for i in range(4)), starts
    for body, frames in zip(bodies, together, strict=True):
        lone = _frames(slow_node, body.replace(b'"four-', b'"lone-'))
        assert len(frames) == len(lone) == MODEL["layers"]
        for a, b in zip(frames, lone, strict=True):
            assert a.payload == b.payload, a.layer
