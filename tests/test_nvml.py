"""The card's own counters (issue 51): NVML read through a fake `pynvml` with nvidia-ml-py's
names, constants and exceptions (checked against the real module); `/health`'s `gpu` and
`mlx_memory`; the dashboard's line beside host→device; `tandem plan`'s link warning."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tandem.app.cli.plan_link import pcie_link, render_link
from tandem.app.tui.card import card_text, link_text
from tandem.app.tui.client import Probe
from tandem.app.tui.messages import NodeProbed
from tandem.app.tui.widgets.bandwidth import BandwidthPanel
from tandem.app.tui.widgets.nodes import NodesTable
from tandem.nodes.contract.cluster import Health
from tandem.nodes.contract.gauges import GPU_GAUGES, MLX_MEMORY_GAUGES
from tandem.nodes.contract.http import PROTO, ContractError
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.measure import nvml
from tandem.nodes.prefill.measure.nvml import GpuReading, NvmlReader, reader_for
from tandem.nodes.serve.node import Node, NodeConfig
from tandem.nodes.serve.readings import NodeReadings, Sampled

from tests.test_tui_snapshots import PREFILL, SIZE, FixedApp, probes

CALLS = (
    "nvmlInit", "nvmlShutdown", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
)  # fmt: skip
CONSTANTS = {"NVML_PCIE_UTIL_TX_BYTES": 0, "NVML_PCIE_UTIL_RX_BYTES": 1, "NVML_TEMPERATURE_GPU": 0}
GIB = 1 << 30


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # nvidia-ml-py's names
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


def fake_nvml(
    link: tuple[int, int, int, int] = (4, 16, 4, 16), fail: dict[str, type[Exception]] | None = None
) -> Any:
    """A `pynvml` as nvidia-ml-py's: `link` is (gen, width, gen max, width max); `fail` maps a
    call to the error it raises; `calls` counts every call by name."""
    fail = fail or {}
    m: Any = types.ModuleType("pynvml")
    m.calls = {}
    m.NVMLError, m.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    m.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    for name, value in CONSTANTS.items():
        setattr(m, name, value)
    gen, width, gen_max, width_max = link
    answers: dict[str, Callable[..., Any]] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByIndex": lambda i: ("index", i),
        "nvmlDeviceGetHandleByPciBusId": lambda bus: ("bus", bus),
        "nvmlDeviceGetHandleByUUID": lambda uuid: ("uuid", uuid),
        # KB/s: 20 GiB/s in, 1 MiB/s out
        "nvmlDeviceGetPcieThroughput": lambda h, c: 20 * 1024 * 1024 if c == 1 else 1024,
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: gen,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: width,
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: gen_max,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: width_max,
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=87, memory=40),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            total=24 * GIB, free=4 * GIB, used=20 * GIB
        ),
        "nvmlDeviceGetTemperature": lambda h, sensor: 64,
        "nvmlDeviceGetPowerUsage": lambda h: 312_500,  # mW
    }

    def counted(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            m.calls[name] = m.calls.get(name, 0) + 1
            if name in fail:
                raise fail[name]()
            return answers[name](*args)

        return call

    for name in CALLS:
        setattr(m, name, counted(name))
    return m


def test_the_fake_has_nvidia_ml_pys_names_constants_and_errors() -> None:
    import pynvml

    assert all(callable(getattr(pynvml, name)) for name in CALLS)
    assert {k: getattr(pynvml, k) for k in CONSTANTS} == CONSTANTS
    assert issubclass(pynvml.NVMLError_NotSupported, pynvml.NVMLError)
    assert issubclass(pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError)
    assert {f.name for f in GpuReading.__dataclass_fields__.values()} == set(GPU_GAUGES)


def test_a_reading_has_the_cards_values_in_their_units() -> None:
    fake = fake_nvml()
    r = NvmlReader(0, nvml=fake).read()
    assert r == GpuReading(
        pcie_rx_Bps=20 * GIB, pcie_tx_Bps=1 << 20, link_gen=4, link_width=16, link_gen_max=4,
        link_width_max=16, util_pct=87, mem_used_bytes=20 * GIB, mem_total_bytes=24 * GIB,
        temp_c=64, power_w=312.5,
    )  # fmt: skip
    assert not r.below_max and r.to_json()["pcie_rx_Bps"] == 20 * GIB
    assert set(r.to_json()) == set(GPU_GAUGES)
    assert nvml.link_Bps(3, 4) == pytest.approx(3.94e9, rel=1e-3) and nvml.link_Bps(None, 4) is None


def test_a_call_not_supported_leaves_just_its_field_out() -> None:
    fake = fake_nvml(fail={"nvmlDeviceGetPowerUsage": NVMLError_NotSupported,
                           "nvmlDeviceGetMemoryInfo": NVMLError})  # fmt: skip
    r = NvmlReader(0, nvml=fake).read()
    assert r is not None and r.power_w is None and r.mem_used_bytes is r.mem_total_bytes is None
    assert set(GPU_GAUGES) - set(r.to_json()) == {"power_w", "mem_used_bytes", "mem_total_bytes"}


def test_no_nvml_or_no_card_is_none_and_costs_nothing_after() -> None:
    for fail in ("nvmlInit", "nvmlDeviceGetHandleByIndex"):
        fake = fake_nvml(fail={fail: NVMLError_LibraryNotFound})
        reader = NvmlReader(0, nvml=fake)
        assert reader.read() is None and reader.read() is None
        assert fake.calls["nvmlInit"] == 1 and "nvmlDeviceGetPcieThroughput" not in fake.calls
    try:  # the real nvidia-ml-py on this machine
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        assert NvmlReader(0).read() is None
    assert reader_for("cpu") is None and reader_for("mps") is None


def test_the_handle_and_the_links_maximum_are_kept() -> None:
    fake = fake_nvml()
    reader = NvmlReader(0, nvml=fake)
    reader.read(), reader.read()
    assert fake.calls["nvmlInit"] == fake.calls["nvmlDeviceGetHandleByIndex"] == 1
    assert fake.calls["nvmlDeviceGetMaxPcieLinkWidth"] == 1
    assert fake.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 2
    reader.close()
    assert fake.calls["nvmlShutdown"] == 1


@pytest.mark.parametrize(("visible", "bus", "handle"), [
    (None, None, ("index", 1)),
    ("3,1", None, ("index", 1)),
    ("GPU-5e1f,GPU-77aa", None, ("uuid", "GPU-77aa")),
    ("3,1", "00000000:41:00.0", ("bus", "00000000:41:00.0")),  # the bus id settles it
])  # fmt: skip
def test_cudas_ordinal_finds_nvmls_card(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, bus: str | None, handle: tuple
) -> None:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    reader = NvmlReader(1, nvml=fake_nvml(), bus_id=bus)
    assert reader.read() is not None and reader._handle == handle


def _node(tiny_model: Callable[..., Path]) -> Node:
    path = tiny_model()
    return Node(NodeConfig(model=path, roles=("prefill",), mdns=False), load_index(path), "ab")


async def test_health_says_the_card_and_mlx_memory(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[..., Path]
) -> None:
    fake = fake_nvml(fail={"nvmlDeviceGetTemperature": NVMLError_NotSupported})
    monkeypatch.setattr(nvml, "reader_for", lambda device: NvmlReader(0, nvml=fake))
    node = _node(tiny_model)
    assert node.health().to_json()["gpu"] is None  # a CPU node, or before the engine runs
    readings = NodeReadings()
    await readings.watch_gpu("cuda:0")
    await readings.watch_mlx()
    node.readings = readings
    try:
        body = json.loads(json.dumps(node.health().to_json()))
        assert body["gpu"]["pcie_rx_Bps"] == 20 * GIB and "temp_c" not in body["gpu"]
        assert set(body["gpu"]) == set(GPU_GAUGES) - {"temp_c"}
        assert set(body["mlx_memory"]) <= set(MLX_MEMORY_GAUGES)
        assert {"active_bytes", "peak_bytes", "cache_bytes"} <= set(body["mlx_memory"])
        assert all(type(v) is int and v >= 0 for v in body["mlx_memory"].values())
        health = Health.from_json(body)
        assert health.gpu == body["gpu"] and health.mlx_memory == body["mlx_memory"]
    finally:
        readings.close()
    assert fake.calls["nvmlShutdown"] == 1


async def test_each_new_reading_is_an_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """`/v1/events` carries the card's readings as they land (a `ReadingEvent`, no request),
    and a reader of the stream gets them back typed, non-numbers left out."""
    from tandem.nodes.contract.events import EventBus, ReadingEvent, event_from_json

    monkeypatch.setattr(nvml, "reader_for", lambda device: NvmlReader(0, nvml=fake_nvml()))
    bus = EventBus("n1")
    seen: list[object] = []
    bus.listen(seen.append)
    readings = NodeReadings(bus.publish)
    try:
        await readings.watch_gpu("cuda:0")
    finally:
        readings.close()
    (event,) = [e for e in seen if isinstance(e, ReadingEvent)]
    assert event.source == "gpu" and event.request_id == "" and event.node == "n1"
    assert event.values["pcie_rx_Bps"] == 20 * GIB
    wire = json.loads(json.dumps({**event.to_dict(), "values": {**event.values, "x": "no"}}))
    back = event_from_json(wire)
    assert isinstance(back, ReadingEvent) and back.values == event.values


def test_older_and_newer_health_bodies_still_read() -> None:
    old = {"id": "n", "proto": PROTO, "model": {"name": "m", "layers": 2}}
    h = Health.from_json(old)
    assert h.gpu is None and h.mlx_memory is None
    newer = {**old, "gpu": {"pcie_rx_Bps": 1.5e9, "fan_pct": 40, "name": "H100", "x": True},
             "mlx_memory": None, "something_new": {"a": [1]}}  # fmt: skip
    assert Health.from_json(newer).gpu == {"pcie_rx_Bps": 1.5e9, "fan_pct": 40}
    with pytest.raises(ContractError, match="gpu"):
        Health.from_json({**old, "gpu": [1, 2]})


def test_a_reading_is_taken_off_the_caller_at_most_every_half_second() -> None:
    now = [0.0]
    reads: list[str] = []
    done = threading.Event()

    def read() -> dict[str, int | float]:
        reads.append(threading.current_thread().name)
        done.set()
        return {"active_bytes": len(reads)}

    sampled = Sampled(read, "test-gauges", clock=lambda: now[0])
    try:
        assert sampled.latest() is None  # the first read starts now, on its own thread
        assert done.wait(5)
        sampled._pool.submit(lambda: None).result()  # the read has ended
        assert sampled.latest() == {"active_bytes": 1}
        now[0] = 0.4
        assert sampled.latest() == {"active_bytes": 1} and len(reads) == 1
        now[0] = 0.6
        sampled.latest()
        sampled._pool.submit(lambda: None).result()
        assert sampled.latest() == {"active_bytes": 2}
        assert all(name.startswith("test-gauges") for name in reads)
    finally:
        sampled.close()
    assert sampled.latest() == {"active_bytes": 2} and len(reads) == 2  # closed: no more


def test_a_reader_that_fails_shows_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> dict[str, int | float]:
        raise OSError("gone")

    sampled = Sampled(broken, "broken")
    with caplog.at_level(logging.ERROR):
        asyncio.run(sampled.prime())
    sampled.close()
    assert sampled.latest() is None and "reading the gauges failed" in caplog.text


# --- tandem plan ---------------------------------------------------------------------------


def test_plan_warns_when_the_link_is_below_the_cards_maximum() -> None:
    def link(at: tuple[int, int, int, int], busy: bool, copy_Bps: float = 3e9) -> Any:
        return pcie_link(busy, copy_Bps, NvmlReader(0, nvml=fake_nvml(at)))

    degraded = link((3, 4, 4, 16), busy=True)
    assert degraded is not None and degraded.below_max
    warning = "PCIe Gen3 x4, the card can do Gen4 x16: host→device is capped near 3.9 GB/s"
    assert render_link(degraded) == [f"  link        {warning}"]
    assert render_link(link((4, 16, 4, 16), busy=True)) == []
    # an idle card's generation says nothing (it drops to Gen1 to save power) ...
    assert not link((1, 16, 4, 16), busy=False).below_max
    # ... nor one the measured copy already beat; the width holds either way
    assert not link((1, 16, 4, 16), busy=True, copy_Bps=20e9).below_max
    narrow = link((1, 8, 4, 16), busy=False)
    assert render_link(narrow) == [
        "  link        PCIe x8, the card can do x16 (Gen4): host→device is capped near 16 GB/s"
    ]
    no_nvml = NvmlReader(0, nvml=fake_nvml(fail={"nvmlInit": NVMLError}))
    assert pcie_link(True, 1e9, no_nvml) is None


def test_plan_report_has_the_link(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from tandem.app.cli import plan_cmd
    from tandem.app.cli.main import main

    monkeypatch.setattr(plan_cmd, "_device", lambda a: ("cuda", True))  # a card here
    fake = fake_nvml((3, 4, 4, 16))
    monkeypatch.setattr(nvml, "reader_for", lambda device: NvmlReader(0, nvml=fake))
    argv = ["plan", "--model", str(tiny_model()), "--budget", "1GiB", "--pcie-gbps", "100",
            "--tflops", "10", "--disk-gbps", "20", "--host-budget", "0"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    link = json.loads(capsys.readouterr().out)["pcie_link"]
    assert (link["gen"], link["width"], link["width_max"], link["below_max"]) == (3, 4, 16, True)
    assert main(argv) == 0
    assert "  link        PCIe x4, the card can do x16 (Gen4)" in capsys.readouterr().out


# --- the dashboard -------------------------------------------------------------------------


def test_the_cards_line_says_what_health_says() -> None:
    gpu = {"pcie_rx_Bps": 24.1e9, "link_gen": 4, "link_width": 16, "link_gen_max": 4,
           "link_width_max": 16}  # fmt: skip
    assert card_text([gpu]) == "card 24.10 GB/s · Gen4 x16" and link_text(gpu) == "Gen4 x16"
    slow = {**gpu, "link_gen": 3, "link_width": 4}
    assert link_text(slow) == "Gen3 x4 / max Gen4 x16"
    assert card_text([]) == "" and card_text([{}]) == "" and link_text({}) == ""
    assert card_text([gpu, slow]) == "2 cards 48.20 GB/s"


async def test_dashboard_shows_the_card_beside_host_to_device() -> None:
    gpu = {"pcie_rx_Bps": 3.5e9, "link_gen": 3, "link_width": 4, "link_gen_max": 4,
           "link_width_max": 16, "power_w": 250.0}  # fmt: skip
    app = FixedApp()
    async with app.run_test(size=SIZE) as pilot:
        for probe in probes():
            app.post_message(NodeProbed(probe))
        await pilot.pause()
        card = app.query_one(BandwidthPanel).query_one(".rate-card")
        assert not card.display  # no node says a card
        for probe in probes():
            if probe.url == PREFILL and probe.health is not None:
                health = Health.from_json({**probe.health.to_json(), "gpu": gpu})
                probe = Probe(probe.url, health, probe.cluster)
            app.post_message(NodeProbed(probe))
        await pilot.pause()
        assert card.display and card.has_class("-degraded")
        assert str(card.render()) == "card 3.50 GB/s · Gen3 x4"
        table = app.query_one(NodesTable)
        device = str(table.get_row(PREFILL)[2])
        assert device == "cuda:0 · Gen3 x4 / max Gen4 x16"


def test_a_ranks_link_says_when_it_runs_below_the_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 52: each rank's card's link in `/health`'s `prefill_ranks` (a pair of cards in a
    desktop board's split slot runs x8/x8)."""
    links = iter([(4, 8, 4, 16), (4, 16, 4, 16)])
    monkeypatch.setattr(nvml, "reader_for",
                        lambda device: NvmlReader(0, nvml=fake_nvml(link=next(links))))  # fmt: skip
    assert nvml.link_of("cuda:1") == "Gen4 x8 (of Gen4 x16)"
    assert nvml.link_of("cuda:0") == "Gen4 x16"
    monkeypatch.undo()
    assert nvml.link_of("cpu") == ""
