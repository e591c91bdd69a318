"""Smoke tests of the benchmarks (their numbers go in notes, not in asserts on time) and of
the host-memory tier they measure."""

from __future__ import annotations

import json

import pytest
from tandem.nodes.contract.events import LinkEvent
from tandem.nodes.model import load_index
from tandem.nodes.prefill.engine import PrefillEngine

from tests.records import listen

PREFILL_KEYS = {
    "wall_s", "load_s", "compute_s", "overlap_ratio", "sequential_ratio", "peak_weight_bytes",
    "peak_activation_bytes", "peak_rss_delta_bytes", "budget_bytes", "model_bytes",
    "bytes_streamed", "tokens", "tokens_per_s", "link_gbps", "disk_Bps", "copy_Bps",
    "loader_Bps", "pinned_bytes",
}  # fmt: skip
E2E_KEYS = {
    "ttft_remote_s", "prefill_s", "ttft_ratio", "kv_bytes", "kv_Bps", "raw_Bps", "kv_ratio",
    "raw_idle_Bps", "decode_tok_s", "mlx_decode_tok_s", "decode_ratio",
}  # fmt: skip


def test_bench_prefill_json(tiny_model, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.nodes.prefill.measure.bench import main

    model = tiny_model(arch="llama", layers=8)
    index = load_index(model)
    budget = sum(index.layer_bytes(i) for i in range(8)) // 4
    args = ["--model", str(model), "--tokens", "96", "--budget", str(budget), "--repeat", "1"]
    # no RAM tier: the load-only runs read the disk, and their rate is measured
    assert main([*args, "--link-gbps", "auto", "--host-budget", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r.keys() >= PREFILL_KEYS
    assert r["peak_weight_bytes"] <= r["budget_bytes"] == budget
    assert r["bytes_streamed"] < r["model_bytes"]  # a resident layer stays loaded
    assert r["link_gbps"] > 0 and r["tokens"] == 96
    assert r["sequential_ratio"] <= r["overlap_ratio"]
    # the loader's rate is capped by the throttled link, and its reads are part of its time
    assert r["loader_Bps"] <= 1.05 * r["link_gbps"] * 1e9 / 8
    assert r["disk_Bps"] >= r["loader_Bps"]
    assert r["pinned_bytes"] == 0  # no CUDA
    assert main([*args, "--cold"]) == 0
    assert "overlap" in capsys.readouterr().out


def test_bench_prefill_vs_resident_runs_streamed_and_resident_in_turns(
    tiny_model, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import statistics

    from tandem.nodes.prefill.measure import bench

    model = tiny_model(arch="llama", layers=8)
    index = load_index(model)
    budget = sum(index.layer_bytes(i) for i in range(8)) // 4
    runs: list[tuple[bool, float]] = []  # (streamed?, wall_s) of each overlapped run

    def run(engine, tokens, **kw):
        stats = real_run(engine, tokens, **kw)
        if not kw:  # overlapped, computing: not a load-only or synchronous phase
            runs.append((engine.plan.n_slots > 0, stats.wall_s))
        return stats

    real_run = bench._run
    monkeypatch.setattr(bench, "_run", run)
    args = ["--model", str(model), "--tokens", "64", "--budget", str(budget), "--repeat", "3"]
    assert bench.main([*args, "--vs", "resident", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # warm-up and 3 wall runs of the streamed engine, then the resident one's warm-up and turns
    turns = runs[4 + 1 :]
    assert [streamed for streamed, _ in turns] == [True, False] * 3
    assert not runs[4][0]  # the second engine holds the whole model
    ratios = [turns[i][1] / turns[i + 1][1] for i in range(0, 6, 2)]
    assert r["vs_resident_ratio"] == pytest.approx(statistics.median(ratios))
    assert r["resident_wall_s"] == pytest.approx(statistics.median(w for _, w in turns[1::2]))
    assert bench.main(args) == 0 and "resident" not in capsys.readouterr().out
    assert bench.main([*args, "--vs", "resident"]) == 0
    assert "streamed / resident" in capsys.readouterr().out


def test_bench_prefill_on_its_own_random_model(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.nodes.prefill.measure.bench import main

    argv = ["--random", "4x128", "--dtype", "float32", "--tokens", "32", "--budget", "600KB"]
    assert main([*argv, "--repeat", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 32


def test_host_tier_reads_less_from_disk(tiny_model) -> None:
    model = tiny_model(arch="llama", layers=8)
    index = load_index(model)
    total = sum(index.layer_bytes(i) for i in range(8))
    engine = PrefillEngine(index, budget=total // 4, device="cpu", host_budget=total // 2)
    disk: list[int] = []
    listen(
        engine.events,
        lambda e: disk.append(e.bytes) if isinstance(e, LinkEvent) and e.name == "disk" else None,
    )
    tokens = list(range(40))
    try:
        first = [layer.k.clone() for layer in engine.prefill(tokens)]
        assert engine.last_stats.disk_bytes == engine.last_stats.bytes_streamed
        disk.clear()
        second = [layer.k for layer in engine.prefill(tokens)]
        stats = engine.last_stats
        tier = engine.streamer.mover.tier
        assert tier is not None and tier.bytes > 0
        assert stats.disk_bytes == stats.bytes_streamed - tier.bytes
        assert sum(disk) == stats.disk_bytes
        assert all((a == b).all() for a, b in zip(first, second, strict=True))
    finally:
        engine.close()


@pytest.mark.serial  # rates at the receiver: a starved decode node reads buffered frames at once
def test_bench_e2e_json(tiny_model, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.app.cli.bench_e2e import main

    model = tiny_model(arch="llama", layers=4)
    argv = ["--model", str(model), "--tokens", "64", "--repeat", "1", "--max-tokens", "4"]
    assert main([*argv, "--net-gbps", "0.01", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r.keys() >= E2E_KEYS
    spec = load_index(model).spec
    kv = 2 * spec.num_layers * spec.num_kv_heads * 63 * spec.head_dim * 4
    assert kv < r["kv_bytes"] < kv + 4096
    # the KV crosses a 0.01 Gbit/s link (1.25 MB/s); a frame's first piece arrives at once
    assert 0.5 * 1.25e6 < r["kv_Bps"] < 1.5 * 1.25e6
    assert 0.5 * 1.25e6 < r["raw_Bps"] < 1.5 * 1.25e6
    assert 0.5 * 1.25e6 < r["raw_idle_Bps"] < 1.5 * 1.25e6
    assert r["decode_tok_s"] > 0 and r["mlx_decode_tok_s"] > 0


@pytest.mark.serial  # rates at the receiver: a starved decode node reads buffered frames at once
def test_bench_e2e_over_tls_takes_a_bare_tls_stream_beside_the_plain_one(
    tiny_model, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.app.cli.bench_e2e import main, table

    model = tiny_model(arch="llama", layers=4)
    argv = ["--model", str(model), "--tokens", "64", "--repeat", "1", "--max-tokens", "4"]
    assert main([*argv, "--net-gbps", "0.01", "--tls", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tls"] is True and r.keys() >= E2E_KEYS | {"raw_tls_Bps", "tls_floor_ratio"}
    # at 1.25 MB/s the link, not TLS, sets every rate: all near it, and TLS costs ~nothing
    for key in ("kv_Bps", "raw_Bps", "raw_tls_Bps"):
        assert 0.5 * 1.25e6 < r[key] < 1.5 * 1.25e6, key
    assert r["kv_ratio"] == pytest.approx(r["kv_Bps"] / r["raw_tls_Bps"])
    assert 0.7 < r["tls_floor_ratio"] < 1.3
    out = table(r)  # the table names both streams
    assert "bare TLS stream" in out and "TLS itself" in out


def test_bench_e2e_reads_a_hybrid_models_nested_config(tiny_model) -> None:
    """Qwen3.5 nests its text config (vocab, heads) in `text_config`: the bench reads the
    model's spec, and its all-full bf16 reference counts every layer, linear ones as full."""
    from tandem.app.cli.bench_e2e import _full_kv_bytes

    spec = load_index(tiny_model(arch="qwen3_5", layers=8, kv_heads=1, head_dim=64)).spec
    assert spec.vocab_size == 512 and spec.linear is not None
    assert _full_kv_bytes(spec, 63) == 2 * 8 * 1 * 64 * 2 * 63  # K and V, bf16


def test_a_bare_stream_whose_frames_each_come_in_one_read_still_has_a_finite_rate() -> None:
    """Frames small enough to arrive whole in one read cannot be timed from their first read
    to their last (`arrival_seconds` has no later bytes): the whole transfer's rate stands
    for them, never an infinite one (the bench once printed `inf MB/s on idle cores`)."""
    import asyncio
    import math

    from tandem.app.cli.bare_stream import _frame_rates, paced_server

    sizes = [512] * 4
    with paced_server([bytes(n) for n in sizes], None, 0.01) as url:
        rates = asyncio.run(_frame_rates(url, sizes))
    assert rates and all(math.isfinite(r) and r > 0 for r in rates)


def test_bench_serve_runs_both_servers_side_by_side(
    tiny_model, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tandem bench serve`: a decode node and mlx_lm.server on the same model, one chat alone
    then a wave at once on each; every reply runs to its token limit (eos biased away)."""
    from tandem.app.cli.bench_serve import main

    model = tiny_model(arch="llama", layers=2)
    args = ["--model", str(model), "--concurrency", "3", "--max-tokens", "5", "--repeat", "1"]
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for name in ("tandem", "mlx_lm_server"):
        s = r[name]
        assert len(s["first_tokens_s"]) == 3 and s["first_tokens_s"] == sorted(s["first_tokens_s"])
        assert s["last_first_token_s"] == s["first_tokens_s"][-1] > 0
        assert s["aggregate_tok_s"] > 0 and s["lone_tok_s"] > 0 and s["lone_ttft_s"] > 0
    assert r["last_first_token_ratio"] > 0 and r["aggregate_ratio"] > 0
    assert isinstance(r["within_wave_bound"], bool) and r["wave_bound_s"] > 0


def test_bench_prefill_batch_streams_the_weights_once_for_n_prompts(
    tiny_model, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--batch N`: N prompts in one pass against N lone passes; the pass's bytes are one
    pass's (its time is the note's, not an assert: this machine is shared)."""
    from tandem.nodes.prefill.measure.bench import main

    model = tiny_model(arch="llama", layers=8)
    index = load_index(model)
    budget = sum(index.layer_bytes(i) for i in range(8)) // 4
    args = ["--model", str(model), "--tokens", "32", "--budget", str(budget), "--repeat", "1"]
    assert main([*args, "--batch", "3", "--host-budget", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["batch"] == 3 and r["batch_bytes"] == r["bytes_streamed"]
    assert r["lone_bytes"] == 3 * r["batch_bytes"]
    assert r["batch_wall_s"] > 0 and r["lone_wall_s"] > 0 and r["batch_ratio"] > 0
    assert main([*args, "--batch", "3"]) == 0
    assert "prompts in one pass" in capsys.readouterr().out


def test_the_serve_bound_is_the_waves_own_prompts_prefilled_alone() -> None:
    """The wave's passages differ in length: its bound scales the lone chat's time to first
    token by each wave prompt's tokens (N times the lone one's where no counts came)."""
    from tandem.app.cli.bench_serve import Timing, _lone_prefills

    lone = Timing(2.0, 5.0, 10, prompt_tokens=100)
    wave = [Timing(3.0, 9.0, 10, prompt_tokens=n) for n in (100, 150, 50)]
    assert _lone_prefills(lone, wave) == pytest.approx(2.0 * 300 / 100)
    assert _lone_prefills(Timing(2.0, 5.0, 10), wave) == pytest.approx(6.0)
