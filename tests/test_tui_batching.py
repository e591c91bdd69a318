"""The dashboard with several requests at once (issue 46): the Nodes panel says a decode
node's batch and a prefill node's queue; the Pipeline panel, under the request it draws, a line
for each other request in flight (its layers sent, its tokens so far)."""

from __future__ import annotations

from tandem.app.tui.cluster import NodeRow
from tandem.app.tui.pipeline import PipelineModel
from tandem.app.tui.widgets.nodes import status_text
from tandem.app.tui.widgets.pipeline import MAX_OTHERS, _others
from tandem.nodes.contract.cluster import Batching, Health, PrefillQueue
from tandem.nodes.contract.events import LayerEvent, RequestEvent, TokenEvent

HEALTH = Health("id", "mac", ("decode",), 4, "0.1", "mlx", 64 << 30, 0, "m", "f" * 64, 4)


def _row(**health: object) -> NodeRow:
    from dataclasses import replace

    return NodeRow("http://mac:8470", replace(HEALTH, **health), status="trusted")


def test_the_nodes_panel_says_each_nodes_load() -> None:
    busy = _row(batching=Batching("continuous", running=4, waiting=1, limit=8, batch=3))
    assert status_text(busy).plain == "● trusted · batch 3/4 +1 waiting"
    queued = _row(queue=PrefillQueue(2, tokens_waiting=1200, running_tokens=300, running=3))
    assert status_text(queued).plain == "● trusted · pass of 3 · queue 2 (1.2k tok)"
    idle = _row(batching=Batching("continuous", 0, 0, 8, 0), queue=PrefillQueue())
    assert status_text(idle).plain == "● trusted"


def test_the_pipeline_lists_the_other_requests_in_flight() -> None:
    model = PipelineModel()
    for rid in ("a", "b", "c", "d"):
        model.apply(RequestEvent(rid, t=1.0, phase="prefill_start", where="http://gpu"))
    for layer in range(3):  # b's prefill: two of three layers sent
        model.apply(LayerEvent("b", t=2.0, layer=layer, state="computing"))
        if layer < 2:
            model.apply(LayerEvent("b", t=2.5, layer=layer, state="sent"))
    model.apply(TokenEvent("c", t=3.0, count=7))  # c is decoding
    model.apply(RequestEvent("d", t=4.0, phase="done"))  # d is over
    model.apply(RequestEvent("a", t=5.0, phase="prefill_start", where="local"))
    assert model.current_id == "a"
    assert [r.request_id for r in model.others_in_flight()] == ["c", "b"]  # newest first
    lines = [line.plain for line in _others(model)]
    assert lines[0] == "  ▸ c · remote · 7 tokens · prefill start"
    assert lines[1] == "  ▸ b · remote · 2/3 layers · prefill start"
    for i in range(MAX_OTHERS + 2):
        model.apply(RequestEvent(f"x{i}", t=6.0, phase="queued"))
    model.apply(RequestEvent("a", t=7.0, phase="prefill_start", where="local"))
    lines = [line.plain for line in _others(model)]
    assert len(lines) == MAX_OTHERS + 1 and lines[-1].startswith("  and ")
