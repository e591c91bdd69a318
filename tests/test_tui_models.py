"""The dashboard's pure state: pipeline, rates, cluster view, units. No Textual, no nodes."""

from __future__ import annotations

import pytest
from tandem.app.tui.client import Probe, normalize
from tandem.app.tui.cluster import ClusterModel
from tandem.app.tui.fmt import format_gbit, format_link, format_rate
from tandem.app.tui.pipeline import PipelineModel
from tandem.app.tui.rates import Bandwidth, RateSeries
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.contract.cluster import Cluster, Health
from tandem.nodes.contract.events import Event, event_from_json
from tandem.nodes.contract.http import PROTO, ContractError

RID = "chatcmpl-1"


def ev(record: dict) -> Event:
    """The event a client reads from a `/v1/events` record (a record without a request id
    reads as one with an empty id)."""
    event = event_from_json({"request_id": "", **record})
    assert event is not None, record
    return event


def layer(i: int, state: str, t: float, node: str = "P", pinned: bool = False) -> dict:
    return {"kind": "layer", "request_id": RID, "node": node, "t": t, "layer": i,
            "state": state, "pinned": pinned}  # fmt: skip


def net_out(t: float, seconds: float) -> dict:
    return {"kind": "link", "request_id": RID, "node": "P", "t": t, "name": "net_out",
            "bytes": 1000, "seconds": seconds}  # fmt: skip


def test_layer_states_fold_in_order_and_keep_history() -> None:
    model = PipelineModel()
    records = [
        layer(0, "queued", 1.0, pinned=True),
        layer(0, "loading", 1.1, pinned=True),
        layer(0, "ready", 1.5, pinned=True),
        layer(0, "computing", 1.5, pinned=True),
        net_out(1.7, 0.05),
        layer(0, "sent", 1.7),  # the prefill node's `sent` record says pinned=False
    ]
    for r in records:
        assert model.apply(ev(r), seen=0.0) == (r["kind"] == "layer")
    track = model.current
    assert track is not None and track.where == "remote"
    lt = track.layers[0]
    assert lt.states("P") == ["queued", "loading", "ready", "computing", "sent"]
    assert lt.state == "sent" and lt.pinned
    spans = lt.spans()
    assert spans["copy"] == [(1.1, 1.5)]
    assert spans["send"] == [pytest.approx((1.65, 1.7))]
    assert spans["compute"] == [pytest.approx((1.5, 1.65))]


def test_received_before_sent_does_not_step_back() -> None:
    # the two nodes' streams race: the decode node's `received` may arrive first
    model = PipelineModel()
    model.apply(ev(layer(2, "computing", 1.0)))
    model.apply(ev(layer(2, "received", 1.2, node="D")))
    model.apply(ev(layer(2, "sent", 1.3)))
    lt = model.requests[RID].layers[2]
    assert lt.state == "received"
    assert lt.states() == ["computing", "received", "sent"]


def test_streamed_layer_in_two_loads_computes_between_them() -> None:
    model = PipelineModel()
    for r in [
        layer(1, "loading", 0.0), layer(1, "ready", 1.0),  # attention weights
        layer(1, "loading", 1.0), layer(1, "computing", 1.0),
        layer(1, "evicted", 1.2),  # attention done, MLP weights still coming
        layer(1, "ready", 2.0), layer(1, "evicted", 2.5), layer(1, "sent", 2.5),
    ]:  # fmt: skip
        model.apply(ev(r))
    tl = model.requests[RID].timeline()
    assert tl is not None
    assert [(a, b) for _, a, b in tl.rows["compute"]] == [(1.0, 1.2), (2.0, 2.5)]
    assert tl.busy["copy"] == pytest.approx(2.0)
    assert tl.busy["compute"] == pytest.approx(0.7)
    assert tl.bound == "copy"


def test_local_prefill_is_named_and_records_without_ids_are_ignored() -> None:
    model = PipelineModel()
    assert not model.apply(ev({"kind": "layer", "layer": 0, "state": "loading"}))
    model.apply(ev({"kind": "request", "request_id": "r2", "phase": "prefill_start",
                    "where": "local"}))  # fmt: skip
    assert model.current is not None and model.current.where == "local"
    assert model.current.timeline() is None


def test_any_clients_request_shows_its_kv_dtype() -> None:
    """The decode node says how each request's KV is held in its prefill_start record (for
    the dashboard's chat and any other client alike): the pipeline's headline shows it."""
    from tandem.app.tui.widgets.pipeline import _headline

    model = PipelineModel()
    model.apply(ev({"kind": "request", "request_id": "api-1", "phase": "prefill_start",
                    "where": "http://10.0.0.2:8470", "detail": "kv q8/g64"}))  # fmt: skip
    assert model.current is not None and model.current.kv_dtype == "q8/g64"
    assert "remote prefill · KV q8/g64 · prefill start" in _headline(model.current).plain
    model.apply(ev({"kind": "request", "request_id": "api-2", "phase": "prefill_start",
                    "where": "local", "detail": "kv BF16"}))  # fmt: skip
    assert "KV BF16" in _headline(model.current).plain


def test_pipeline_keeps_only_recent_requests() -> None:
    model = PipelineModel(keep=3)
    for k in range(5):
        model.apply(ev({**layer(0, "loading", float(k)), "request_id": f"r{k}"}))
    assert list(model.requests) == ["r2", "r3", "r4"]
    assert model.current_id == "r4"


def test_rate_series_buckets_and_peak() -> None:
    s = RateSeries(bucket_s=0.5)
    s.add(1_000_000, now=10.0)
    s.add(1_000_000, now=10.2)
    s.roll(10.6)  # first bucket closed: 2 MB in 0.5 s
    assert s.current == pytest.approx(4e6)
    s.roll(11.6)  # two idle buckets
    assert list(s.values) == [pytest.approx(4e6), 0.0, 0.0]
    assert s.peak == pytest.approx(4e6)


def test_bandwidth_counts_token_deltas_per_request() -> None:
    bw = Bandwidth.empty(bucket_s=1.0)
    tok = {"kind": "token", "request_id": "a"}
    assert bw.apply(ev({**tok, "count": 10}), now=0.0)
    assert bw.apply(ev({**tok, "count": 25}), now=0.5)
    assert bw.apply(ev({"kind": "link", "name": "h2d", "bytes": 500}), now=0.5)
    assert not bw.apply(ev({"kind": "request", "phase": "done"}), now=0.5)
    bw.roll(1.0)
    assert bw.series["tokens"].current == 25
    assert bw.series["h2d"].current == 500


def _health(name: str, roles: list[str]) -> Health:
    return Health.from_json({"id": name, "name": name, "roles": roles, "proto": PROTO,
                             "device": "cpu", "mem_bytes": 2 * 10**9, "budget_bytes": 10**8,
                             "model": {"name": "m", "fingerprint": "f", "layers": 8}})  # fmt: skip


def test_cluster_learns_peers_and_says_what_changed() -> None:
    model = ClusterModel()
    model.add("127.0.0.1:1")
    peer = {"address": "http://127.0.0.1:2", "name": "p", "trusted": True, "reason": None,
            "prefill_tok_s": 900.0, "link_Bps": 1.25e8}  # fmt: skip
    d = Probe("http://127.0.0.1:1", _health("d", ["decode"]),
              Cluster.from_json({"self": {}, "peers": [peer]}))  # fmt: skip
    changes = model.update(d)
    assert [c.text for c in changes] == ["d joined (decode, cpu)"]
    p_row = model.rows["http://127.0.0.1:2"]
    assert p_row.status == "connecting" and p_row.prefill_tok_s == 900.0
    p = Probe("http://127.0.0.1:2", _health("p", ["prefill"]),
              Cluster.from_json({"self": {}, "peers": []}))  # fmt: skip
    assert [c.severity for c in model.update(p)] == ["information"]
    assert [r.name for r in model.trusted("prefill")] == ["p"]
    gone = Probe("http://127.0.0.1:2", None, None, "unreachable", "connection refused")
    changes = model.update(gone)
    assert changes[0].severity == "warning" and "p left" in changes[0].text
    assert model.rows["http://127.0.0.1:2"].status == "unreachable"
    assert model.update(gone) == []  # said once


def test_cluster_shows_rejections_by_us_and_by_peers() -> None:
    model = ClusterModel()
    bad = Probe("http://h:1", _health("x", ["prefill"]), None, "unauthorized", "not our token")
    (change,) = model.update(bad)
    assert change.severity == "error" and "different token" in change.text
    assert model.rows["http://h:1"].reason == "unauthorized"
    # a node we can talk to, that the decode node rejects for its model
    peer = {"address": "http://h:3", "trusted": False, "reason": "model_mismatch"}
    model.update(
        Probe("http://h:2", _health("d", ["decode"]), Cluster.from_json({"peers": [peer]}))
    )
    model.update(Probe("http://h:3", _health("q", ["prefill"]), Cluster.from_json({"peers": []})))
    row = model.rows["http://h:3"]
    assert (row.status, row.reason) == ("rejected", "model_mismatch")


def test_units_and_reply_stats() -> None:
    assert format_rate(6.25e6) == "6.2 MB/s"
    assert format_rate(1.25e9) == "1.25 GB/s"
    assert format_gbit(1.25e9) == "10 Gbit/s"
    assert format_gbit(6.25e6) == "50.0 Mbit/s"
    assert format_link(1.25e8) == "125.0 MB/s · 1.00 Gbit/s"
    assert normalize("10.0.0.2:8470/") == "http://10.0.0.2:8470"
    stats = ReplyStats.from_json({"prefill": "remote", "prefill_tokens": 100, "prefill_s": 0.5,
                                  "decode_tokens": 10, "decode_s": 0.0, "extra": 1})  # fmt: skip
    assert stats.prefill_tok_s == 200 and stats.decode_tok_s is None


def test_malformed_records_and_health_are_ignored_not_raised() -> None:
    model, bw = PipelineModel(), Bandwidth.empty()
    for junk in [
        {"kind": "layer", "request_id": RID, "layer": "0", "state": "loading"},
        {"kind": "layer", "request_id": RID, "layer": 10**9, "state": "loading"},
        {"kind": "layer", "request_id": RID, "layer": 1, "state": "sent", "t": "soon"},
        {"kind": "link", "request_id": RID, "name": "net_out", "seconds": [1]},
        {"kind": "link", "name": "h2d", "bytes": "many"},
        {"kind": "token", "request_id": RID, "count": {}},
    ]:
        event = event_from_json(junk)  # what a client reads: nothing, for each of these
        if event is not None:
            model.apply(event)
            bw.apply(event, now=0.0)
    assert all(not t.layers for t in model.requests.values())
    odd = {"id": 7, "name": None, "roles": "prefill", "mem_bytes": "lots", "model": [],
           "proto": 1}  # fmt: skip
    with pytest.raises(ContractError):  # the client calls such a node's reply a bad one
        Health.from_json(odd)
    junk_view = Cluster.from_json({"self": {"prefill_tok_s": "fast"}, "peers": [1]})
    cluster = ClusterModel()
    cluster.update(Probe("http://h:1", None, junk_view))
    row = cluster.rows["http://h:1"]
    assert row.status == "trusted" and row.mem_bytes == 0 and row.roles == ()
