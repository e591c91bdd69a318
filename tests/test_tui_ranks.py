"""Issue 52 item 3: a prefill node of two devices on the dashboard. Its layer events carry
their rank: the Pipeline panel draws a copy and a compute lane per rank (rank 0's first), the
Nodes panel says "2 devices" with each rank's device and last pass under it; a node of one
device draws as before (tests/test_tui_snapshots.py, unchanged)."""

from __future__ import annotations

from typing import Any

import pytest
from tandem.app.tui.client import Probe
from tandem.app.tui.messages import NodeProbed, NodeRecord
from tandem.app.tui.pipeline import PipelineModel, lanes
from tandem.app.tui.rates import Bandwidth
from tandem.app.tui.widgets.nodes import NodesTable
from tandem.app.tui.widgets.pipeline import PipelineView
from tandem.nodes.contract.cluster import Cluster, Health
from tandem.nodes.contract.events import Event, LinkEvent, event_from_json
from tandem.nodes.contract.http import PROTO
from tandem.nodes.contract.ranks import PrefillRank, PrefillRanks

from tests.test_tui_layer_kinds import panel_text
from tests.test_tui_snapshots import DECODE, PREFILL, SIZE, FixedApp

RID = "chatcmpl-tw0card5"
LAYERS = 6
COPY_S = {0: 0.30, 1: 0.40}  # bytes/s alike, rank 1's link a little slower
COMPUTE_S = 0.05
MIB = 1 << 20
RANKS = PrefillRanks(2, "nccl", (
    PrefillRank(0, "cuda:0", 20_000_000_000, 25.0, (0,), 600 * MIB, 100 * MIB, 500 * MIB, 0,
                pass_bytes=500 * MIB, pass_reduced_bytes=3 * MIB, pass_s=1.9),
    PrefillRank(1, "cuda:1", 20_000_000_000, 12.5, (0,), 600 * MIB, 100 * MIB, 500 * MIB, 0,
                pass_bytes=501 * MIB, pass_reduced_bytes=3 * MIB, pass_s=1.9),
))  # fmt: skip


def prefill_health(ranks: PrefillRanks | None) -> Health:
    body = {"status": "ok", "id": "P", "name": "gpu-box", "roles": ["prefill"], "proto": PROTO,
            "device": "cuda:0", "mem_bytes": 64_000_000_000, "budget_bytes": 20_000_000_000,
            "model": {"name": "demo-llama", "fingerprint": "6bf3", "layers": LAYERS},
            "prefill_ranks": ranks.to_json() if ranks else None}  # fmt: skip
    return Health.from_json(body)


def two_ranks(ranks: tuple[int, ...] = (0, 1)) -> list[Event]:
    """One request's pass on each rank as the node's `/v1/events` tells it: layer 0 resident,
    the others streamed (one copy at a time per rank), computed in step; rank 0 sends."""
    out: list[dict[str, Any]] = []

    def emit(t: float, rank: int, kind: str, **fields: Any) -> None:
        record = {"t": 1000.0 + t, "node": "P", "kind": kind, "request_id": RID, **fields}
        out.append(record if rank == 0 else {**record, "rank": rank})  # as on the wire

    done = [0.0] * LAYERS  # when every rank has computed the layer (the all-reduces)
    for rank in ranks:
        copy_t = compute_t = 0.0
        for i in range(LAYERS):
            emit(0.0, rank, "layer", layer=i, state="queued", pinned=i == 0)
            ready = 0.0
            if i:
                emit(copy_t, rank, "layer", layer=i, state="loading", bytes=MIB)
                copy_t += COPY_S[rank]
                ready = copy_t
                emit(ready, rank, "link", name="h2d", bytes=MIB, seconds=COPY_S[rank])
                emit(ready, rank, "layer", layer=i, state="ready", bytes=MIB)
            start = max(compute_t, ready)
            emit(start, rank, "layer", layer=i, state="computing", pinned=i == 0)
            compute_t = start + COMPUTE_S
            if i:
                emit(compute_t, rank, "layer", layer=i, state="evicted")
            done[i] = max(done[i], compute_t)
    for i in range(LAYERS):
        emit(done[i] + 0.01, 0, "link", name="net_out", bytes=4096, seconds=0.01)
        emit(done[i] + 0.01, 0, "layer", layer=i, state="sent", bytes=4096)
    out.sort(key=lambda r: r["t"])
    events = [event_from_json(r) for r in out]
    assert all(e is not None for e in events)
    return events  # type: ignore[return-value]


def test_each_ranks_copies_and_computes_make_its_own_lanes() -> None:
    model = PipelineModel()
    for event in two_ranks():
        model.apply(event, seen=0.0)
    req = model.current
    assert req is not None and req.ranks == 2
    tl = req.timeline()
    assert tl is not None
    assert tuple(tl.rows) == lanes(2) == ("copy 0", "compute 0", "copy 1", "compute 1", "send")
    for rank in (0, 1):  # every streamed layer copied, every layer computed, on each rank
        assert [i for i, _, _ in tl.rows[f"copy {rank}"]] == list(range(1, LAYERS))
        assert [i for i, _, _ in tl.rows[f"compute {rank}"]] == list(range(LAYERS))
        assert tl.busy[f"copy {rank}"] == pytest.approx((LAYERS - 1) * COPY_S[rank])
    assert len(tl.rows["send"]) == LAYERS
    assert tl.bound == "copy"
    # the layer cells are rank 0's: rank 1's records never step a sent layer back
    assert all(req.layers[i].state == "sent" for i in range(LAYERS))
    assert [i for i in range(LAYERS) if req.layers[i].pinned] == [0]


def test_one_rank_draws_the_three_rows_of_before() -> None:
    model = PipelineModel()
    for event in two_ranks((0,)):
        model.apply(event, seen=0.0)
    req = model.current
    assert req is not None and req.ranks == 1
    tl = req.timeline()
    assert tl is not None and tuple(tl.rows) == ("copy", "compute", "send")
    wide = req.timeline(ranks=2)  # /health says two ranks before rank 1's records arrive
    assert wide is not None and tuple(wide.rows) == lanes(2) and wide.rows["copy 1"] == []


def test_each_ranks_untimed_copies_are_its_own() -> None:
    """CUDA: untimed per-load copies, then the pass's timed total (not counted twice), per
    rank: rank 1's copies do not spoil rank 0's sum."""
    bw = Bandwidth.empty()
    for rank in (0, 1):
        for _ in range(3):
            assert bw.apply(LinkEvent(RID, name="h2d", bytes=100, rank=rank), 0.0)
    assert not bw.apply(LinkEvent(RID, name="h2d", bytes=300, seconds=0.1), 0.0)
    assert not bw.apply(LinkEvent(RID, name="h2d", bytes=300, seconds=0.1, rank=1), 0.0)


def _lane_cells(text: str, lane: str) -> str:
    """The strip of `lane` in the panel's text: its cells between the label and busy time."""
    line = next(ln for ln in text.splitlines() if ln.startswith(f"{lane} "))
    return line[len("compute 0 ") : -9]


async def test_the_dashboard_draws_both_cards_lanes_and_devices() -> None:
    app = FixedApp()
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(NodeProbed(Probe(PREFILL, prefill_health(RANKS), Cluster(None))))
        for event in two_ranks():
            app.post_message(NodeRecord(PREFILL, event, seen=0.0))
        await pilot.pause()
        text = panel_text(app.query_one(PipelineView))
        for lane in lanes(2):
            cells = _lane_cells(text, lane)
            assert cells.strip("·"), (lane, text)  # something drawn on every lane
        for rank in (0, 1):  # its five copies, labelled by layer where they fit
            assert "1" in _lane_cells(text, f"copy {rank}")
        assert "timeline" in text and "copy-bound" in text
        order = [ln.split()[0] + ln.split()[1] for ln in text.splitlines()[-5:-1]]
        assert order == ["copy0", "compute0", "copy1", "compute1"]  # rank 0's first
        table = app.query_one(NodesTable)
        node = [str(c) for c in table.get_row(PREFILL)]
        assert node[2] == "2 devices (nccl)"
        for rank in RANKS.ranks:
            row = [str(c) for c in table.get_row(f"{PREFILL}#prefill-rank{rank.rank}")]
            assert row[0].strip() == f"└ rank {rank.rank}" and row[2] == f"cuda:{rank.rank}"
            assert row[3] == f"budget 20 GB · last pass {500 + rank.rank} MiB"


async def test_health_says_two_ranks_before_rank_1s_records_arrive() -> None:
    app = FixedApp()
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(NodeProbed(Probe(PREFILL, prefill_health(RANKS), Cluster(None))))
        for event in two_ranks((0,)):
            app.post_message(NodeRecord(PREFILL, event, seen=0.0))
        await pilot.pause()
        text = panel_text(app.query_one(PipelineView))
        assert set(_lane_cells(text, "copy 1")) == {"·"}  # its lane, empty for now
        assert _lane_cells(text, "copy 0").strip("·")
        # the same node as one device: the rows of before, no device rows
        app.post_message(NodeProbed(Probe(PREFILL, prefill_health(None), Cluster(None))))
        await pilot.pause()
        assert "copy 1" not in panel_text(app.query_one(PipelineView))
        keys = [row.key.value for row in app.query_one(NodesTable).ordered_rows]
        assert not any("#prefill-rank" in str(k) for k in keys) and DECODE in keys


async def _feed_two_cards(pilot: Any) -> None:
    app = pilot.app
    app.post_message(NodeProbed(Probe(PREFILL, prefill_health(RANKS), Cluster(None))))
    for event in two_ranks():
        app.post_message(NodeRecord(PREFILL, event, seen=0.0))
    await pilot.pause()
    app.clear_notifications()
    await pilot.pause()


def test_two_cards_snapshot(snap_compare: Any) -> None:
    assert snap_compare(FixedApp(), terminal_size=SIZE, run_before=_feed_two_cards)
