"""Snapshots of the dashboard at 120×40, fed a fixed cluster and a fixed event stream (no
live nodes, so every run draws the same screen), plus the help screen and the palette.

Update the SVGs with `pytest tests/test_tui_snapshots.py --snapshot-update` and look at
them before committing (`assets/dashboard.svg` is a copy of the dashboard one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

from tandem.app.tui.app import TandemApp
from tandem.app.tui.client import ChatPart, Delta, Probe
from tandem.app.tui.messages import NodeProbed, NodeRecord
from tandem.app.tui.widgets.chat import ChatPanel
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.contract.cluster import Cluster, Health
from tandem.nodes.contract.events import Event, event_from_json
from tandem.nodes.contract.http import PROTO

SIZE = (120, 40)
DECODE = "http://10.0.0.3:8470"
PREFILL = "http://10.0.0.2:8470"
STRANGER = "http://10.0.0.7:8470"
GONE = "http://10.0.0.9:8470"
RID = "chatcmpl-5d1c0ffee"
LAYERS, RESIDENT = 8, (0, 1)
COPY_S, COMPUTE_S, SEND_S = 0.46, 0.06, 0.02  # a throttled link: copy-bound
CUT_S = 2.33  # the moment shown: layer 6 computing, layer 7 loading
REPLY = (
    "The keeper climbed the **spiral stair** at dusk, as he had for forty years.\n\n"
    "- trimmed the wick\n- wound the clockwork\n- wrote the weather in the log"
)


def _health(node_id: str, name: str, roles: list[str], device: str, mem: float,
            budget: float) -> Health:  # fmt: skip
    return Health.from_json(
        {"status": "ok", "id": node_id, "name": name, "roles": roles, "proto": PROTO,
         "device": device, "mem_bytes": int(mem), "budget_bytes": int(budget),
         "model": {"name": "demo-llama", "fingerprint": "6bf3", "layers": LAYERS}})  # fmt: skip


def probes() -> list[Probe]:
    peer = {"address": PREFILL, "name": "gpu-box", "trusted": True, "reason": None,
            "prefill_tok_s": 2140.0, "link_Bps": 1.17e9}  # fmt: skip
    return [
        Probe(DECODE, _health("D", "mac-studio", ["decode"], "mlx", 192e9, 0),
              Cluster.from_json({"self": {}, "peers": [peer]})),
        Probe(PREFILL, _health("P", "gpu-box", ["prefill"], "cuda:0", 64e9, 12e9),
              Cluster.from_json({"self": {"prefill_tok_s": 2140.0}, "peers": []})),
        Probe(STRANGER, _health("S", "laptop", ["prefill"], "mps", 16e9, 8e9), None,
              "unauthorized", "the node does not hold our token"),
        Probe(GONE, None, None, "unreachable", "connection refused"),
    ]  # fmt: skip


def recorded_stream() -> list[tuple[str, Event]]:
    """One request as the two nodes report it, cut at `CUT_S`: resident layers compute at
    once, the others wait for their copy (one copy at a time), each K/V is sent when done."""
    out: list[tuple[float, str, dict[str, Any]]] = []

    def emit(t: float, url: str, kind: str, **fields: Any) -> None:
        node = "P" if url == PREFILL else "D"
        out.append((t, url, {"t": 1000.0 + t, "node": node, "kind": kind,
                             "request_id": RID, **fields}))  # fmt: skip

    emit(0.0, DECODE, "request", phase="prefill_start", tokens=412, where=PREFILL)
    for i in range(LAYERS):
        emit(0.0, PREFILL, "layer", layer=i, state="queued", pinned=i in RESIDENT)
    copy_t = compute_t = 0.0
    for i in range(LAYERS):
        pinned = i in RESIDENT
        ready = 0.0
        if not pinned:
            emit(copy_t, PREFILL, "layer", layer=i, state="loading", bytes=3_000_000)
            copy_t += COPY_S
            ready = copy_t
            emit(ready, PREFILL, "link", name="disk", bytes=3_000_000, seconds=0.01)
            emit(ready, PREFILL, "link", name="h2d", bytes=3_000_000, seconds=COPY_S)
            emit(ready, PREFILL, "layer", layer=i, state="ready", bytes=3_000_000)
        start = max(compute_t, ready)
        emit(start, PREFILL, "layer", layer=i, state="computing", pinned=pinned)
        compute_t = start + COMPUTE_S
        if not pinned:
            emit(compute_t, PREFILL, "layer", layer=i, state="evicted")
        sent = compute_t + SEND_S
        emit(sent, PREFILL, "link", name="net_out", bytes=421_000, seconds=SEND_S)
        emit(sent, PREFILL, "layer", layer=i, state="sent", bytes=421_000)
        emit(sent + 0.005, DECODE, "layer", layer=i, state="received", bytes=421_000)
    out.sort(key=lambda x: x[0])
    return [(url, _event(record)) for t, url, record in out if t <= CUT_S]


def _event(record: dict[str, Any]) -> Event:
    event = event_from_json(record)  # as the dashboard's client reads it
    assert event is not None, record
    return event


BANDWIDTH = {  # bytes/s (tokens/s) per 0.5 s bucket: two earlier requests, then this one
    "disk": [0, 0, 9e8, 2e7, 0, 0, 0, 0, 0, 6.5e6, 6.5e6, 6.5e6, 6.5e6, 6.5e6],
    "h2d": [0, 0, 6.2e6, 6.3e6, 6.2e6, 0, 0, 0, 0, 6.5e6, 6.5e6, 6.5e6, 6.4e6, 6.5e6],
    "net_out": [0, 0, 0, 8e5, 8e5, 9e5, 0, 0, 0, 0, 8e5, 8e5, 8e5, 9e5],
    "net_in": [0, 0, 0, 8e5, 8e5, 9e5, 0, 0, 0, 0, 8e5, 8e5, 8e5, 9e5],
    "tokens": [0, 0, 0, 0, 0, 0, 96, 142, 138, 20, 0, 0, 0, 0],
}


class FakeClient:
    """Stands in for the decode node's OpenAI API: a fixed reply in a few pieces."""

    temperatures: ClassVar[list[float | None]] = []  # what each chat asked for

    async def chat(
        self, messages: list[dict[str, str]], max_tokens: int = 256,
        temperature: float | None = None,
    ) -> AsyncIterator[ChatPart]:  # fmt: skip
        FakeClient.temperatures.append(temperature)
        for start in range(0, len(REPLY), 40):
            yield Delta(REPLY[start : start + 40])
        yield ReplyStats(RID, "remote", PREFILL, 412, 0.19, 3_368_000, 0.31, 48, 0.35)


class FixedApp(TandemApp):
    def __init__(self) -> None:
        super().__init__([DECODE], token=None, mdns=False, live=False)

    def chat_client(self) -> Any:
        return FakeClient()


async def feed(pilot: Any) -> None:
    """The fixed cluster, stream, bandwidth and one chat exchange; then a still screen."""
    app: FixedApp = pilot.app
    for probe in probes():
        app.post_message(NodeProbed(probe))
    for url, record in recorded_stream():
        app.post_message(NodeRecord(url, record, seen=0.0))
    await pilot.pause()
    for name, values in BANDWIDTH.items():
        series = app.bandwidth.series[name]
        series.values.extend(values)
        series.peak = max(values)
    app.show_bandwidth()
    await pilot.click("#prompt")
    await pilot.press(*"Tell me a story about a lighthouse keeper.", "enter")
    chat = app.query_one(ChatPanel)
    while chat.busy:
        await pilot.pause(0.02)
    prompt = app.query_one("#prompt")
    prompt.cursor_blink = False  # type: ignore[attr-defined]
    app.clear_notifications()
    await pilot.pause()


def test_dashboard_snapshot(snap_compare: Any) -> None:
    FakeClient.temperatures.clear()
    assert snap_compare(FixedApp(), terminal_size=SIZE, run_before=feed)
    assert FakeClient.temperatures == [0.0]  # the dashboard's chat decodes greedily


def test_help_screen_snapshot(snap_compare: Any) -> None:
    assert snap_compare(FixedApp(), terminal_size=SIZE, press=["f1"])


async def test_fixed_stream_draws_the_pipeline_it_describes() -> None:
    app = FixedApp()
    async with app.run_test(size=SIZE) as pilot:
        await feed(pilot)
        req = app.query_one("#pipeline").model.current  # type: ignore[attr-defined]
        assert req is not None and req.request_id == RID
        assert [req.layers[i].state for i in range(LAYERS)] == ["received"] * 6 + [
            "computing", "loading",
        ]  # fmt: skip
        assert [i for i in range(LAYERS) if req.layers[i].pinned] == list(RESIDENT)
        timeline = req.timeline()
        assert timeline is not None and timeline.bound == "copy"
        rows = {r.url: r for r in app.cluster.rows.values()}
        assert (rows[STRANGER].status, rows[STRANGER].reason) == ("rejected", "unauthorized")
        assert rows[GONE].status == "unreachable"
        assert rows[PREFILL].prefill_tok_s == 2140.0
        reply = app.query_one(ChatPanel).replies[-1]
        assert reply.text == REPLY and reply.stats is not None


async def test_every_action_is_in_the_palette_and_works_from_it() -> None:
    app = FixedApp()
    async with app.run_test(size=SIZE) as pilot:
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"Help", "New chat", "Cancel reply", "Refresh nodes"} <= titles
        await feed(pilot)
        chat = app.query_one(ChatPanel)
        assert len(chat.history) == 2
        await pilot.press("ctrl+p")
        await pilot.press(*"New chat")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert chat.history == [] and chat.replies == []
        await pilot.press("f1")
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        assert app.screen.__class__.__name__ != "HelpScreen"
