"""Issue 34 item 1: system RAM as the second tier, by default (`--host-budget auto`).

A warm pass on a machine whose RAM holds the streamed set reads nothing from disk; where RAM
holds part of it, that part is fixed and the rest is read every pass; `0` turns it off. The
machine's free RAM is given to `ram.read_meminfo` here, so the tests do not depend on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine, PrefillStats
from tandem.nodes.prefill.planning import ram
from tandem.nodes.prefill.planning.plan import make_plan
from tandem.nodes.prefill.planning.ram import (
    OS_RESERVE_MIN,
    HostBudget,
    parse_host_budget,
    spare_ram,
    tier_bytes,
)

from tests.conftest import MakeTiny

GIB = 1 << 30
LAYERS = 6
TOKENS = list(range(24))


def plenty(monkeypatch: pytest.MonkeyPatch, spare: int = 64 * GIB) -> None:
    """This machine's RAM, as the kernel would say it: `spare` bytes over the OS's room."""
    total = 256 * GIB
    monkeypatch.setattr(ram, "read_meminfo", lambda: (total, spare + int(0.1 * total)))


def passes(engine: PrefillEngine, n: int) -> list[PrefillStats]:
    out = []
    for _ in range(n):
        for _ in engine.prefill(TOKENS):
            pass
        out.append(engine.last_stats)
    return out


def quarter_budget(model: Path) -> tuple[int, int]:
    index = load_index(model)
    layers = sum(index.layer_bytes(i) for i in range(LAYERS))
    return layers // 4, layers


def test_host_budget_values() -> None:
    assert parse_host_budget("auto") == parse_host_budget(" AUTO ") == "auto"
    assert parse_host_budget("0") == 0
    assert parse_host_budget("16GiB") == 16 * GIB
    for bad in ("lots", "-1GiB", ""):
        with pytest.raises(ValueError, match="--host-budget takes 'auto', 0 or a size"):
            parse_host_budget(bad)


def test_auto_leaves_room_for_the_os_and_what_the_node_takes_beside() -> None:
    # 10% of 64 GiB is more than the 2 GiB minimum; of 8 GiB it is less
    assert spare_ram(0, (64 * GIB, 40 * GIB)) == 40 * GIB - int(6.4 * GIB)
    assert spare_ram(GIB, (8 * GIB, 5 * GIB)) == 5 * GIB - OS_RESERVE_MIN - GIB
    assert spare_ram(0, (8 * GIB, GIB)) == 0  # never negative
    assert tier_bytes("auto", 3 * GIB, 0, (64 * GIB, 40 * GIB)) == 3 * GIB  # all of it fits
    assert tier_bytes("auto", 90 * GIB, 0, (64 * GIB, 40 * GIB)) == 40 * GIB - int(6.4 * GIB)
    assert tier_bytes(GIB, 3 * GIB) == GIB and tier_bytes(0, 3 * GIB) == 0
    assert tier_bytes(None, 3 * GIB) == 0 and tier_bytes("auto", 0) == 0


def test_the_commands_and_the_node_default_to_auto() -> None:
    from tandem.app.cli.main import build_parser
    from tandem.nodes.prefill.measure.bench import build_parser as bench_parser
    from tandem.nodes.serve.node import NodeConfig

    p = build_parser()
    node = p.parse_args(["node", "--model", "m"])
    prefill = p.parse_args(["prefill", "--model", "m", "--tokens-file", "t", "--out", "o"])
    bench = bench_parser().parse_args(["--model", "m", "--budget", "1MiB"])
    assert node.host_budget == prefill.host_budget == bench.host_budget == "auto"
    assert NodeConfig(model=Path("m")).host_budget == "auto"
    assert p.parse_args(["node", "--model", "m", "--host-budget", "0"]).host_budget == 0


@contextmanager
def cpu_engine(tiny_model: MakeTiny, host_budget: HostBudget) -> Iterator[PrefillEngine]:
    """An engine on the CPU for a quarter of a tiny model's layers."""
    model = tiny_model(arch="llama", layers=LAYERS)
    budget, _ = quarter_budget(model)
    engine = PrefillEngine(model, budget=budget, device="cpu", host_budget=host_budget)
    try:
        yield engine
    finally:
        engine.close()


def test_a_warm_pass_reads_nothing_from_disk_when_ram_holds_the_set(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    plenty(monkeypatch)
    with cpu_engine(tiny_model, "auto") as engine:
        cold, warm, again = passes(engine, 3)
        plan = engine.plan
        assert plan.n_slots and plan.host_loads  # layers stream, and RAM keeps them
        assert plan.disk_bytes == 0 and plan.ram_bytes == plan.streamed_bytes
        assert cold.ram_bytes == 0 and cold.disk_bytes == cold.bytes_streamed  # read once
        for s in (warm, again):
            assert s.bytes_streamed == plan.streamed_bytes > 0
            assert s.disk_bytes == 0 and s.ram_bytes == s.bytes_streamed
        assert warm.to_json()["ram_bytes"] == warm.bytes_streamed


def test_a_partial_tier_is_fixed_and_the_rest_comes_from_disk(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(arch="llama", layers=LAYERS)
    budget, layers = quarter_budget(model)
    held = 2 * load_index(model).spec.kv_bytes_per_token * 4096  # what a request holds
    plenty(monkeypatch, spare=budget + held + layers // 2)  # on a CPU the budget is RAM too
    engine = PrefillEngine(model, budget=budget, device="cpu", host_budget="auto")
    try:
        plan = engine.plan
        tier = engine.streamer.mover.tier
        assert tier is not None and tier.members == set(plan.host_loads)
        streamed = [ld.seq for ld in plan.loads if not ld.resident]
        held = sorted(plan.host_loads)
        n, k = len(streamed), len(held)
        assert 0 < k < n and held == [streamed[j * n // k] for j in range(k)]  # spread evenly
        assert plan.ram_bytes > 0 and plan.disk_bytes > 0
        _, warm, again = passes(engine, 3)
        for s in (warm, again):  # the same split every pass: never LRU
            assert (s.ram_bytes, s.disk_bytes) == (plan.ram_bytes, plan.disk_bytes)
        assert tier.members == set(held)
    finally:
        engine.close()


def test_host_budget_zero_turns_it_off(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    plenty(monkeypatch)
    with cpu_engine(tiny_model, 0) as engine:
        assert engine.streamer.mover.tier is None and not engine.plan.host_loads
        _, warm = passes(engine, 2)
        assert warm.ram_bytes == 0 and warm.disk_bytes == warm.bytes_streamed > 0


def test_prefill_stats_json_and_bench_json_report_ram_bytes(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from tandem.app.cli.main import main
    from tandem.nodes.prefill.measure import bench

    plenty(monkeypatch)
    model = tiny_model(arch="llama", layers=LAYERS)
    budget, _ = quarter_budget(model)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    stats = tmp_path / "stats.json"
    out = tmp_path / "cache.safetensors"
    argv = ["prefill", "--model", str(model), "--tokens-file", str(tokens), "--out", str(out),
            "--budget", str(budget), "--device", "cpu"]  # fmt: skip
    assert main([*argv, "--stats-json", str(stats)]) == 0
    one = json.loads(stats.read_text())  # one pass: cold, the tier filled from disk
    assert one["ram_bytes"] == 0 and one["disk_bytes"] == one["bytes_streamed"]
    args = ["--model", str(model), "--tokens", "24", "--budget", str(budget), "--repeat", "1"]
    assert bench.main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)  # after the warm-up: from RAM
    assert r["disk_bytes"] == 0 and r["ram_bytes"] == r["bytes_streamed"] > 0
    assert r["ram_tier_bytes"] >= r["ram_bytes"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--host-budget", "lots"])
    assert done.value.code == 2
    assert "--host-budget takes 'auto', 0 or a size" in capsys.readouterr().err


@pytest.mark.cuda
def test_on_cuda_a_warm_pass_copies_from_pinned_ram(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier is pinned once, at its size; a warm pass reads no disk and gives the same
    K/V as a node without the tier."""
    plenty(monkeypatch)
    model = tiny_model(arch="llama", layers=LAYERS)
    budget, _ = quarter_budget(model)
    kv = []
    for host_budget in ("auto", 0):
        engine = PrefillEngine(model, budget=budget, device="cuda", host_budget=host_budget)
        try:
            tier = engine.streamer.mover.tier
            if host_budget:
                assert tier is not None and tier.pinned_bytes >= tier.bytes > 0
            for _ in engine.prefill(TOKENS):  # cold: the tier is filled from disk
                pass
            kv.append([layer.k.cpu() for layer in engine.prefill(TOKENS)])
            warm = engine.last_stats
            if host_budget:
                assert warm.disk_bytes == 0 and warm.ram_bytes == warm.bytes_streamed > 0
            else:
                assert warm.ram_bytes == 0 and warm.disk_bytes == warm.bytes_streamed
        finally:
            engine.close()
    assert all(a.equal(b) for a, b in zip(*kv, strict=True))


async def test_a_prefill_node_says_its_tiers_in_health(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.nodes.contract.cluster import WeightTiers
    from tandem.nodes.serve.node import Node, NodeConfig
    from tandem.nodes.serve.prefill_side import prefill_service, start_prefill

    plenty(monkeypatch)
    model = tiny_model(arch="llama", layers=LAYERS)
    budget, _ = quarter_budget(model)
    config = NodeConfig(model=model, roles=("prefill",), budget=budget, device="cpu", mdns=False)
    node = Node(config, load_index(model), "ab")  # --host-budget: auto, as the command's
    assert node.health().tiers is None  # not started
    node.prefill = prefill_service(node)
    await start_prefill(node)
    try:
        plan = node.prefill.engine.plan
        tiers = WeightTiers(device=plan.resident_bytes, ram=plan.streamed_bytes, disk=0)
        assert node.health().tiers == tiers and tiers.ram > 0
    finally:
        node.prefill.close()


def test_auto_runs_from_disk_where_the_tier_cannot_be_pinned(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.nodes.prefill.stream import host

    def refuse(*a: object, **kw: object) -> None:
        raise host.PinError("cannot pin")

    plenty(monkeypatch)
    monkeypatch.setattr(host, "HostTier", refuse)
    index = load_index(tiny_model(arch="llama", layers=LAYERS))
    plan = make_plan(index, sum(index.layer_bytes(i) for i in range(LAYERS)) // 4)
    assert host.host_tier(plan, "auto", 0, pin=True) == (plan, None)
    with pytest.raises(host.PinError):
        host.host_tier(plan, GIB, 0, pin=True)


def test_the_prefix_cache_is_sized_with_the_tier_and_requests_are_deducted(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46 item 4: `--prefix-cache auto` takes a quarter of the spare RAM (at least 1 GiB
    where RAM has it), a size as asked, 0 none; the RAM tier's `auto` then leaves room for it
    and for what a request holds (its prompt's K/V twice: handover copies and upload)."""
    meminfo = (256 * GIB, 40 * GIB + int(0.1 * 256 * GIB))  # 40 GiB over the OS's room
    assert ram.prefix_cache_bytes("auto", 0, meminfo) == 10 * GIB
    assert ram.prefix_cache_bytes("auto", 36 * GIB, meminfo) == GIB  # at least 1 GiB
    assert ram.prefix_cache_bytes("auto", 40 * GIB - 100, meminfo) == 100  # what there is
    assert ram.prefix_cache_bytes(3 * GIB) == 3 * GIB and ram.prefix_cache_bytes(0) == 0
    assert ram.parse_host_budget("8GiB", "--prefix-cache") == 8 * GIB
    with pytest.raises(ValueError, match="--prefix-cache takes"):
        ram.parse_host_budget("some", "--prefix-cache")

    model = tiny_model(arch="llama", layers=LAYERS)
    budget, layers = quarter_budget(model)
    spec = load_index(model).spec
    # a request's K/V, twice, at the longest prompt: nothing bounds it on a CPU, so the
    # model's context (4096) up to REQUEST_TOKENS
    held = 2 * spec.kv_bytes_per_token * 4096
    # RAM for the budget, the requests, a 1 GiB cache, and half the streamed layers
    plenty(monkeypatch, spare=budget + held + GIB + layers // 2)
    engine = PrefillEngine(model, budget=budget, device="cpu", host_budget="auto",
                           prefix_cache="auto")  # fmt: skip
    try:
        assert engine.request_tokens == 4096
        assert engine.prefix_cache_bytes == GIB
        sized = engine.plan.host_bytes  # what is left after the cache: half the layers
    finally:
        engine.close()
    plain = PrefillEngine(model, budget=budget, device="cpu", host_budget="auto")
    try:
        assert plain.prefix_cache_bytes is None  # its caller sizes the cache
        assert 0 < sized <= layers // 2 < plain.plan.host_bytes
    finally:
        plain.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_routed_experts_enter_the_tier_from_short_prompts(
    arch: str, tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48 item 6: a node that served only short prompts (a few experts chosen per
    layer) serves those experts from RAM on its next pass; a new prompt reads from disk only
    the experts no pass chose before. (A routed load was kept only once read whole.)"""
    plenty(monkeypatch)
    model = tiny_model(arch=arch, layers=4, experts=16, top_k=2, vocab=320)
    index = load_index(model)
    budget = sum(index.layer_bytes(i) for i in range(4)) // 4
    engine = PrefillEngine(model, budget=budget, device="cpu", host_budget="auto")
    engine.route_experts = "always"  # what the routers chose, whatever waiting costs here
    try:
        assert any(ld.routed for ld in engine.plan.loads if ld.seq in engine.plan.host_loads)
        stats = []
        for ids in ([5, 9], [5, 9], [5, 9, 200]):
            list(engine.prefill(ids))
            stats.append(engine.last_stats)
        first, same, more = stats
        assert first.disk_bytes > 0 and first.experts_streamed
        assert same.disk_bytes == 0 and same.ram_bytes == same.bytes_streamed > 0
        assert 0 < more.disk_bytes < first.disk_bytes  # only experts never chosen before
    finally:
        engine.close()


def test_a_tier_of_uneven_loads_fills_its_budget_spread_through_the_cycle() -> None:
    """A MoE model's cycle: a small attention load before each layer's large expert loads.
    An even spread by count that fits takes mostly the small ones; the rest of the tier then
    goes to the others, spread by bytes (GLM-4.5-Air bf16: 10.2 of 60 GiB used before)."""
    from types import SimpleNamespace

    from tandem.nodes.prefill.planning.plan import host_set

    loads = [
        SimpleNamespace(seq=i, resident=False, nbytes=250 if i % 4 == 0 else 2000)
        for i in range(4 * 40)
    ]
    total = sum(ld.nbytes for ld in loads)
    chosen = host_set(loads, total // 3)  # type: ignore[arg-type]
    held = sum(loads[i].nbytes for i in chosen)
    assert 0.9 * (total // 3) <= held <= total // 3
    halves = [sum(1 for i in chosen if (i < 80) == first) for first in (True, False)]
    assert min(halves) >= 0.7 * max(halves)  # spread, not bunched at the start
