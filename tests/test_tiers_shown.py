"""Issue 34 items 1 and 6: the three tiers (device, RAM, disk) in `/health`, `tandem plan` and
the dashboard, and host→device bytes counted once on the dashboard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tandem.app.cli.main import main
from tandem.app.tui.cluster import NodeRow
from tandem.app.tui.rates import Bandwidth
from tandem.app.tui.widgets.nodes import row_cells
from tandem.nodes.contract.cluster import Health, WeightTiers
from tandem.nodes.contract.events import Event, LinkEvent
from tandem.nodes.contract.http import ContractError
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning import cost
from tandem.nodes.prefill.stream.movers import FillTimes

from tests.conftest import MakeTiny
from tests.records import listen
from tests.test_plan_cmd import write_headers_only

GIB = 1 << 30
HW = ["--device", "cuda", "--budget", "24GiB", "--tokens", "4096", "--pcie-gbps", "200",
      "--disk-gbps", "50", "--tflops", "150", "--net-gbps", "10", "--mac-tok-s", "400"]  # fmt: skip


def health(tiers: WeightTiers | None) -> Health:
    return Health("p", "gpu", ("prefill",), 3, "0", "cuda:0", 64 * GIB, 20 * GIB, "m", "f", 80,
                  tiers=tiers)  # fmt: skip


def test_health_says_the_tiers_and_reads_an_older_body() -> None:
    h = health(WeightTiers(device=20 * GIB, ram=100 * GIB, disk=7 * GIB))
    body = json.loads(json.dumps(h.to_json()))
    assert body["tiers"] == {"device": 20 * GIB, "ram": 100 * GIB, "disk": 7 * GIB}
    assert Health.from_json(body) == h
    older = {k: v for k, v in body.items() if k != "tiers"}
    assert Health.from_json(older).tiers is None
    assert Health.from_json({**body, "tiers": None}).tiers is None
    with pytest.raises(ContractError, match="tiers"):
        Health.from_json({**body, "tiers": [1, 2]})
    with pytest.raises(ContractError, match="ram"):
        Health.from_json({**body, "tiers": {"ram": "lots"}})


def test_the_nodes_panel_shows_the_tiers() -> None:
    row = NodeRow("http://gpu:8470", health(WeightTiers(20_000_000_000, 9_000_000_000, 0)))
    memory = row_cells(row)[3]
    assert memory == "69 GB / 21 GB · dev 20 GB · RAM 9.0 GB · disk 0 kB"
    assert row_cells(NodeRow("http://gpu:8470", health(None)))[3] == "69 GB / 21 GB"


@pytest.fixture(scope="module")
def l70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_headers_only(tmp_path_factory.mktemp("tiers") / "llama-3-70b")


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tandem_plan_shows_three_tiers_and_predicts_with_them(
    l70b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", str(l70b), *HW]
    off = plan_json(capsys, *model, "--host-budget", "0")
    auto = plan_json(capsys, *model)  # a card not here: its RAM assumed to hold the set
    part = plan_json(capsys, *model, "--host-budget", "60GiB")
    per_pass = off["plan"]["bytes_per_pass"]
    assert off["tiers"]["ram_bytes"] == 0 and off["tiers"]["disk_bytes"] == per_pass
    assert off["tiers"]["device_bytes"] == off["plan"]["resident_bytes"] > 10 * GIB
    assert auto["tiers"]["host_budget_source"] == "assumed"
    assert auto["tiers"]["disk_bytes"] == 0 and auto["tiers"]["ram_bytes"] == per_pass
    t = part["tiers"]
    assert t["host_budget_source"] == "given" and t["host_budget_bytes"] == 60 * GIB
    assert 50 * GIB < t["ram_bytes"] <= 60 * GIB and t["ram_bytes"] + t["disk_bytes"] == per_pass
    # the disk bounds the pass without the tier; with it, PCIe does, at its floor
    assert off["bound"] == "disk" and auto["bound"] == "pcie"
    pcie_floor = per_pass / auto["hardware"]["copy_Bps"]
    assert auto["predicted_wall_s"] <= 1.05 * pcie_floor < off["predicted_wall_s"]
    assert auto["disk_s"] == 0
    assert off["predicted_wall_s"] > part["predicted_wall_s"] > auto["predicted_wall_s"]
    # a partial tier spread through the cycle: the link copies from RAM while the disk reads
    # the rest, so the pass stays near the slower of the two (held in a row: their sum)
    assert part["predicted_wall_s"] <= 1.15 * max(part["disk_s"], part["copy_s"])
    assert main(["plan", *model]) == 0
    assert "tiers       device" in capsys.readouterr().out


def test_the_cost_model_reads_the_ram_tier_from_the_plan(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(arch="llama", layers=6))
    layers = sum(index.layer_bytes(i) for i in range(6))
    plan = cost.node_plan(index, layers // 4)
    held = cost.node_plan(index, layers // 4, host_bytes=layers)
    assert not plan.host_loads and held.disk_bytes == 0 and held.ram_bytes == plan.disk_bytes
    hw = cost.Hardware("cpu", copy_Bps=1e12, disk_Bps=1e6, flops=1e15, net_Bps=1e9, mac_tok_s=1)
    slow, fast = cost.predict(plan, index, 8, hw), cost.predict(held, index, 8, hw)
    assert slow.disk_bytes == slow.bytes_per_pass and fast.ram_bytes == fast.bytes_per_pass
    assert fast.disk_s == 0 and slow.bound == "disk" and fast.wall_s < slow.wall_s / 100


def cuda_node_events(tiny_model: MakeTiny) -> tuple[list[Event], int]:
    """The link events a CUDA prefill node publishes for one pass, and its bytes streamed: the
    engine's own per-load hook with `CudaMover`'s fill times (copy seconds 0: its copies are
    timed only at the end), then the closing `h2d` event as `PrefillEngine._finish` makes it."""
    model = tiny_model(arch="llama", layers=6)
    index = load_index(model)
    budget = sum(index.layer_bytes(i) for i in range(6)) // 4
    engine = PrefillEngine(model, budget=budget, device="cpu")
    events: list[Event] = []
    listen(engine.events, events.append)
    try:
        ready = engine.pass_events.on_ready(["r1"])
        streamed = 0
        for load in engine.plan.loads:  # a first pass: every load, from disk
            nbytes = load.weight_bytes
            ready(load, engine.streamer.slot_of(load), FillTimes(0.01, 0.0, nbytes, nbytes))
            streamed += nbytes
    finally:
        engine.close()
    events.append(LinkEvent("r1", name="h2d", bytes=streamed, seconds=0.25))
    return [e for e in events if isinstance(e, LinkEvent)], streamed


def test_the_dashboard_counts_host_to_device_bytes_once(tiny_model: MakeTiny) -> None:
    events, streamed = cuda_node_events(tiny_model)
    assert sum(e.bytes for e in events if e.name == "h2d") == 2 * streamed  # as published
    bw = Bandwidth.empty(bucket_s=1.0)
    for e in events:
        bw.apply(e, now=0.5)
    bw.roll(1.0)
    assert bw.series["h2d"].current == streamed  # bytes/s over the 1 s bucket: once
    assert bw.series["disk"].current == streamed
    # a second pass of another request counts afresh; a CPU node's timed loads all count
    for e in events:
        bw.apply(LinkEvent("r2", name=e.name, bytes=e.bytes, seconds=e.seconds), now=1.5)
    cpu = [LinkEvent("c", name="h2d", bytes=100, seconds=0.001) for _ in range(3)]
    for e in cpu:
        bw.apply(e, now=1.5)
    bw.roll(2.0)
    assert bw.series["h2d"].current == streamed + 300
