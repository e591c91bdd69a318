"""Issue 36 item 3: a mixture of experts' layers say, as their routers choose, how many of
their experts they read (a `routed` layer event), and the pipeline panel shows it."""

from __future__ import annotations

import json

from tandem.app.tui.widgets.pipeline import PipelineView
from tandem.nodes.contract.events import LayerEvent, RequestEvent, event_from_json

from tests.test_tui_layer_kinds import panel_text

RID = "chatcmpl-m0e"


def test_a_routed_event_reads_back_and_an_older_reader_skips_nothing() -> None:
    e = LayerEvent(RID, t=1.0, node="p", layer=2, state="routed", experts=3, experts_total=8)
    assert event_from_json(json.loads(json.dumps(e.to_dict()))) == e
    bare = {"kind": "layer", "request_id": RID, "layer": 1, "state": "ready"}
    assert event_from_json(bare) == LayerEvent(RID, layer=1, state="ready")  # no experts: 0


def test_the_pipeline_panel_shows_the_experts_each_layer_read() -> None:
    view = PipelineView()
    view.apply(RequestEvent(RID, phase="prefill_start", where="p"))
    for layer, read in ((0, 3), (2, 2), (3, 8)):
        view.apply(LayerEvent(RID, layer=layer, state="computing", node="p"))
        view.apply(LayerEvent(RID, layer=layer, state="routed", node="p", experts=read,
                              experts_total=8, bytes=read * 1024))  # fmt: skip
    view.apply(LayerEvent(RID, layer=1, state="computing", node="p"))  # a dense layer
    text = panel_text(view)
    assert "experts read  0:3/8  2:2/8  3:8/8  · 13 of 24 in all, 13.0 KiB streamed" in text
    # a bad count from a confused node is not drawn
    view.apply(LayerEvent(RID, layer=1, state="routed", node="p", experts=9, experts_total=8))
    assert "1:9/8" not in panel_text(view)


def test_a_dense_models_panel_has_no_experts_line() -> None:
    view = PipelineView()
    view.apply(RequestEvent(RID, phase="prefill_start", where="p"))
    view.apply(LayerEvent(RID, layer=0, state="computing", node="p"))
    assert "experts" not in panel_text(view)
