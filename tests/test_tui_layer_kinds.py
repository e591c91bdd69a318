"""Issue 35 item 6: `/health` says each layer's kind, and the dashboard's pipeline panel
letters global and sliding layers and shows the K/V bytes per layer; issue 37: linear layers
(Qwen3.5's Gated DeltaNet) lettered L, their frame a fixed-size state."""

from __future__ import annotations

import json

import pytest
from rich.console import Group
from tandem.app.tui.client import Probe
from tandem.app.tui.messages import NodeProbed, NodeRecord
from tandem.app.tui.widgets.pipeline import PipelineView
from tandem.nodes.contract.cluster import Cluster, Health, ModelLayer
from tandem.nodes.contract.events import LayerEvent, RequestEvent
from tandem.nodes.contract.http import PROTO
from tandem.nodes.model.index import load_index
from tandem.nodes.serve.node import Node, NodeConfig

from tests.conftest import MakeTiny
from tests.test_tui_snapshots import DECODE, SIZE, FixedApp

RID = "chatcmpl-w1nd0w"
SLIDING, GLOBAL, LINEAR = ModelLayer("sliding", 4), ModelLayer(), ModelLayer("linear")
KINDS = (SLIDING, SLIDING, GLOBAL, SLIDING, SLIDING, GLOBAL)  # every 3rd layer global
HYBRID = (LINEAR, LINEAR, LINEAR, GLOBAL) * 2  # Qwen3.5: full attention every 4th layer
# bytes of a 24-token prompt: window 4; a linear layer's state (any prompt)
FRAME = {"sliding": 4 * 1024, "full": 24 * 1024, "linear": 140 * 1024, "latent": 13 * 1024}


def gemma_health(kinds: tuple[ModelLayer, ...]) -> Health:
    return Health.from_json(
        {"status": "ok", "id": "D", "name": "mac", "roles": ["prefill", "decode"],
         "proto": PROTO, "device": "mlx", "model": {"name": "gemma", "fingerprint": "ab",
         "layers": len(kinds), "layer_kinds": [k.to_json() for k in kinds]}})  # fmt: skip


def test_health_carries_layer_kinds_and_reads_an_older_body() -> None:
    h = gemma_health(KINDS)
    assert h.layer_kinds == KINDS
    assert Health.from_json(json.loads(json.dumps(h.to_json()))) == h
    older = h.to_json()
    del older["model"]["layer_kinds"]  # a node from before this field
    assert Health.from_json(older).layer_kinds == ()
    for bad in ([1], [{"kind": 3}], [{"kind": "sliding", "window": "4"}], [{"window": 0}], {}):
        with pytest.raises(ValueError):
            Health.from_json({**h.to_json(), "model": {"layer_kinds": bad}})


def test_a_node_fills_its_models_layer_kinds(tiny_model: MakeTiny) -> None:
    path = tiny_model(arch="gemma3", layers=6, sliding_window=4, sliding_window_pattern=3)
    node = Node(NodeConfig(model=path, mdns=False), load_index(path), "ab")
    assert node.health().layer_kinds == KINDS
    llama = tiny_model(layers=2)
    assert Node(NodeConfig(model=llama), load_index(llama), "cd").health().layer_kinds == (
        GLOBAL, GLOBAL
    )  # fmt: skip


def panel_text(view: PipelineView) -> str:
    group = view.render()
    assert isinstance(group, Group)
    return "\n".join(str(getattr(part, "plain", "")) for part in group.renderables)


async def show(kinds: tuple[ModelLayer, ...]) -> str:
    """The panel after a node with `kinds` and one request whose layers were all sent."""
    app = FixedApp()
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(NodeProbed(Probe(DECODE, gemma_health(kinds), Cluster(None))))
        app.post_message(
            NodeRecord(
                DECODE, RequestEvent(RID, phase="prefill_start", where="http://gpu"), seen=0.0
            )
        )
        for i, kind in enumerate(kinds):
            sent = LayerEvent(RID, t=1.0 + i, layer=i, state="sent", bytes=FRAME[kind.kind])
            app.post_message(NodeRecord(DECODE, sent, seen=0.0))
        await pilot.pause()
        view = app.query_one(PipelineView)
        assert view.layer_kinds == kinds
        return panel_text(view)


async def test_the_pipeline_letters_global_and_sliding_layers_with_their_bytes() -> None:
    text = await show(KINDS)
    assert "  0S    1S    2G    3S    4S    5G " in text
    assert "G global  S sliding window" in text
    assert "KV per layer  G 24.0 KiB ×2  S 4.0 KiB ×4 (window 4)  · 64.0 KiB in all" in text


async def test_a_model_of_full_layers_keeps_plain_cells_and_one_byte_figure() -> None:
    text = await show((GLOBAL,) * 3)
    assert "  0    1    2 " in text and "G global" not in text
    assert "KV per layer  24.0 KiB ×3  · 72.0 KiB in all" in text


async def test_the_pipeline_letters_linear_layers_and_shows_their_state_bytes() -> None:
    text = await show(HYBRID)
    assert "  0L    1L    2L    3G    4L    5L    6L    7G " in text
    assert "G global  L linear (state)" in text and "S sliding" not in text
    assert "KV per layer  G 24.0 KiB ×2  L 140.0 KiB ×6 (state, fixed)  · 888.0 KiB in all" in (
        text
    )


async def test_the_pipeline_letters_latent_layers() -> None:
    """DeepSeek V3: every layer a latent one (a latent and a rope key a position)."""
    text = await show((ModelLayer("latent"),) * 3)
    assert "  0M    1M    2M " in text and "M latent (MLA)" in text
    assert "KV per layer  M 13.0 KiB ×3  · 39.0 KiB in all" in text


def test_a_node_says_its_qwen3_5_layers_are_linear_or_full(tiny_model: MakeTiny) -> None:
    path = tiny_model(arch="qwen3_5", layers=8, full_attention_interval=4)
    node = Node(NodeConfig(model=path, mdns=False), load_index(path), "ab")
    assert node.health().layer_kinds == HYBRID
