"""The dashboard against real nodes: a prefill node and a decode node started as processes
on free ports (the demo's launcher, on the 4-layer tiny model), driven through Pilot.
Assertions read widget state, not pixels."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tandem.app.cli.demo import DemoCluster, free_port
from tandem.app.tui.app import TandemApp
from tandem.app.tui.widgets.chat import ChatPanel, Reply
from tandem.app.tui.widgets.pipeline import PipelineView
from tandem.nodes.trust.auth import new_token

# 300 kB of weight slots for ~185 kB layers: no resident set, every layer streams in two
# loads on every request; 0.01 Gbit/s makes each layer take ~0.15 s, long enough to catch.
BUDGET = "300000"
LINK_GBPS = 0.004  # ~0.4 s per streamed layer: room to press Escape mid-prefill


@pytest.fixture(scope="module")
def cluster(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DemoCluster]:
    nodes = DemoCluster(tmp_path_factory.mktemp("cluster"), new_token())
    try:
        nodes.start(tiny_model(layers=4), link_gbps=LINK_GBPS, budget=BUDGET)
        asyncio.run(nodes.wait_ready(timeout=90))
        yield nodes
    finally:
        nodes.stop()


class RecordingApp(TandemApp):
    """The dashboard, remembering every notification it showed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[tuple[str, str]] = []

    def notify(self, message: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.notes.append((message, str(kwargs.get("severity", "information"))))
        super().notify(message, *args, **kwargs)


async def until(pilot: Any, check: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check.__doc__ or check}")
        await pilot.pause(0.05)


def in_order(states: list[str], *wanted: str) -> bool:
    """`wanted` appear in `states` as a subsequence."""
    it = iter(states)
    return all(any(s == w for s in it) for w in wanted)


def live_app(cluster: DemoCluster) -> RecordingApp:
    # only the decode node is given: the prefill node is learned from its /v1/cluster
    return RecordingApp([cluster.decode_url], cluster.token, mdns=False, poll_s=0.5)


async def connected(pilot: Any, app: TandemApp, n: int = 2) -> None:
    await until(pilot, lambda: len(app.cluster.trusted()) == n and len(app.streaming) == n)


async def test_prompt_streams_a_reply_while_every_layer_moves_through_the_pipeline(
    cluster: DemoCluster,
) -> None:
    app = live_app(cluster)
    async with app.run_test(size=(120, 40)) as pilot:
        await connected(pilot, app)
        prefill_id = app.cluster.rows[cluster.prefill_url].id
        decode_id = app.cluster.rows[cluster.decode_url].id
        await pilot.click("#prompt")
        await pilot.press(*"Tell me about the sea", "enter")
        chat = app.query_one(ChatPanel)
        await until(pilot, lambda: chat.replies and not chat.busy, timeout=60)
        reply: Reply = chat.replies[-1]
        assert reply.stats is not None, reply.query_one(".reply-stats").render()
        assert reply.stats.prefill == "remote"
        assert reply.text and reply.query_one("Markdown").source == reply.text
        assert "remote prefill on demo-prefill" in str(reply.query_one(".reply-stats").render())
        assert chat.history == [
            {"role": "user", "content": "Tell me about the sea"},
            {"role": "assistant", "content": reply.text},
        ]

        model = app.query_one(PipelineView).model
        req = model.requests[reply.stats.request_id]
        # the two event streams can trail the reply by a moment
        await until(pilot, lambda: all(req.layer(i).state == "received" for i in range(4)))
        assert req.n_layers == 4 and req.where == "remote"
        for i in range(4):
            lt = req.layers[i]
            assert in_order(lt.states(prefill_id), "loading", "computing", "sent"), lt.states()
            assert lt.states(decode_id) == ["received"]
        sent0 = next((s.seen for s in req.layers[0].history if s.state == "sent"), None)
        assert reply.first_text_at is not None and sent0 is not None
        assert sent0 < reply.first_text_at  # layer 0 left before the first token showed
        timeline = req.timeline()
        assert timeline is not None and timeline.bound in ("copy", "compute")
        assert all(len({layer for layer, _, _ in timeline.rows[r]}) == 4 for r in ("copy", "send"))

        series = app.bandwidth.series  # a bucket closes on the next 0.5 s tick
        await until(pilot, lambda: all(series[s].peak > 0 for s in ("h2d", "net_in", "tokens")))


async def test_escape_cancels_the_reply_and_the_remote_prefill(cluster: DemoCluster) -> None:
    app = live_app(cluster)
    async with app.run_test(size=(120, 40)) as pilot:
        await connected(pilot, app)
        chat = app.query_one(ChatPanel)
        pipeline = app.query_one(PipelineView)
        await pilot.click("#prompt")
        await pilot.press(*"A long question", "enter")

        def prefill_started() -> bool:  # of our request (the decode node probes too)
            req = pipeline.model.current
            return (
                req is not None
                and req.request_id.startswith("chatcmpl-")
                and any(lt.state in ("computing", "sent") for lt in req.layers.values())
            )

        await until(pilot, prefill_started)
        await pilot.press("escape")
        await until(pilot, lambda: not chat.busy)
        reply = chat.replies[-1]
        assert reply.stats is None and reply.has_class("-failed")
        assert "cancelled" in str(reply.query_one(".reply-stats").render())
        req = pipeline.model.current
        assert req is not None
        await until(pilot, lambda: req.phase == "cancelled")
        # cancelled before any text: the unanswered prompt leaves the history
        assert reply.text == "" and chat.history == []

        await pilot.press("ctrl+n")  # a new chat forgets it
        assert chat.history == [] and chat.replies == []


def _start_node(model: Path, workdir: Path, token: str) -> tuple[str, subprocess.Popen[bytes]]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "token").write_text(token)
    port = free_port()
    env = {**os.environ, "XDG_CONFIG_HOME": str(workdir / "config")}
    env.pop("TANDEM_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.app", "node", "--role", "prefill", "--model", str(model),
         "--port", str(port), "--no-mdns", "--token-file", str(workdir / "token")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    return f"http://127.0.0.1:{port}", proc


@pytest.fixture
def lone_nodes(
    tiny_model: Callable[..., Path], tmp_path: Path, cluster: DemoCluster
) -> Iterator[dict[str, tuple[str, subprocess.Popen[bytes]]]]:
    """A prefill node holding the cluster's token and one holding another token."""
    model = tiny_model(layers=4)
    nodes = {
        "ours": _start_node(model, tmp_path / "ours", cluster.token),
        "stranger": _start_node(model, tmp_path / "stranger", new_token()),
    }
    yield nodes
    for _, proc in nodes.values():
        proc.kill()
        proc.wait()


async def test_a_node_that_leaves_or_refuses_the_token_is_shown_and_notified(
    cluster: DemoCluster, lone_nodes: dict[str, tuple[str, subprocess.Popen[bytes]]]
) -> None:
    ours, proc = lone_nodes["ours"]
    stranger, _ = lone_nodes["stranger"]
    app = RecordingApp([ours, stranger], cluster.token, mdns=False, poll_s=0.5)
    async with app.run_test(size=(120, 40)) as pilot:
        rows = app.cluster.rows
        await until(pilot, lambda: rows[ours].status == "trusted", timeout=60)
        await until(pilot, lambda: rows[stranger].status == "rejected", timeout=60)
        assert rows[stranger].reason == "unauthorized"
        assert any("rejected" in text and sev == "error" for text, sev in app.notes)

        proc.kill()
        proc.wait()
        await until(pilot, lambda: rows[ours].status == "unreachable", timeout=10)
        assert any(" left" in text and sev == "warning" for text, sev in app.notes)
        table = app.query_one("#nodes")
        cells = [str(c) for c in table.get_row(ours)]  # type: ignore[attr-defined]
        assert any("unreachable" in c for c in cells)
        assert app.is_running


async def test_live_updates_while_the_help_screen_is_open(cluster: DemoCluster) -> None:
    from tandem.app.tui.screens.help import HelpScreen
    from tandem.app.tui.widgets.nodes import NodesTable

    app = live_app(cluster)
    async with app.run_test(size=(120, 40)) as pilot:
        await connected(pilot, app)
        redraws: list[int] = []
        show_nodes = app.show_nodes

        def counting() -> None:
            redraws.append(1)
            show_nodes()

        app.show_nodes = counting  # type: ignore[method-assign]
        await pilot.press("f1")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        seen = len(redraws)
        # node probes (every 0.5 s here) keep updating the dashboard behind the help screen
        await until(pilot, lambda: len(redraws) >= seen + 3)
        assert app.is_running and isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        assert app.query_one(NodesTable).row_count >= 2
