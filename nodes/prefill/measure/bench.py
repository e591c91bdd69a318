"""`tandem bench prefill`: is the streamed prefill fast, and is the overlap real?

In one run, on one prompt, after a warm-up pass (which loads the resident set):
- `compute_s`: the sum of per-load compute times with each load fetched synchronously first,
  so no copy overlaps (works when the model exceeds the budget);
- `load_s`: every load streamed through the budget with compute switched off, with the
  loader's rates: `loader_Bps` (bytes / loader busy time), `disk_Bps` and `copy_Bps` (the
  host→device copy: CUDA only; on a CPU the read lands in the slot);
- `wall_s`: the real, overlapped prefill; `disk_bytes` and `ram_bytes`: where its last run's
  streamed bytes came from (the RAM tier, `--host-budget auto` by default, holds what it can
  once the warm-up has read it); `--vs resident`: `vs_resident_ratio`, streamed / resident
  wall, in turns in this process; `--batch N`: `batch_ratio`, N prompts in one pass / N lone
  passes (bench_batch.py); `--ranks N`: `ranks_ratio`, N ranks' pass / this device's.
`overlap_ratio = wall / max(load, compute)` (1.0: copy fully hidden) and
`sequential_ratio = wall / (load + compute)` (1.0: no overlap at all). The isolated runs are
the denominators on purpose: on a small CPU the loader thread slows compute, and a ratio
taken inside the overlapped run would hide that. Each phase runs `--repeat` times; medians.

On a bare CUDA box (torch, safetensors, numpy): `python3 scripts/bench-prefill --random
32x2048 --tokens 1024 --budget 1GiB`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tandem.nodes.contract.http import DEFAULT_CHUNK_TOKENS, KVFormat
from tandem.nodes.contract.units import parse_size
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.locate import locate
from tandem.nodes.model.page_cache import evict_page_cache
from tandem.nodes.prefill.engine import PrefillEngine, PrefillStats
from tandem.nodes.prefill.measure.bench_batch import vs_lone
from tandem.nodes.prefill.measure.bench_ranks import table_lines, vs_ranks
from tandem.nodes.prefill.measure.bench_table import table
from tandem.nodes.prefill.planning import ram

log = logging.getLogger(__name__)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(engine: PrefillEngine, tokens: list[int], **kw: Any) -> PrefillStats:
    t0 = time.perf_counter()
    for _ in engine.prefill(tokens, **kw):
        pass
    stats = engine.last_stats
    if engine.device.type == "cuda":  # the last layer's MLP still runs once its K/V are out
        torch.cuda.synchronize(engine.device)
        stats.wall_s = max(stats.wall_s, time.perf_counter() - t0)
    return stats


def _median(runs: int, fn: Callable[[], float], before: Callable[[], None]) -> float:
    values = []
    for _ in range(runs):
        before()
        values.append(fn())
    return statistics.median(values)


def _rate(runs: list[tuple[int, float]]) -> float | None:
    """Median bytes/s over runs that moved bytes and took time (None: none did)."""
    rates = [n / t for n, t in runs if n and t > 0]
    return statistics.median(rates) if rates else None


@dataclass
class _Phases:
    """What the phases of one bench measured (seconds: medians over `--repeat` runs)."""

    compute_s: float
    load_s: float
    wall_s: float
    loaded: list[PrefillStats]  # the load-only runs
    last: PrefillStats  # the last overlapped run
    rss: list[int]  # per overlapped run: peak RSS over the start (-1: not measurable)
    link_gbps: float | None
    quantize_s: float | None
    side_by_side: dict[str, object]


def bench(
    model: Path,
    tokens: int,
    budget: int,
    link_gbps: float | str | None = None,
    device: str | None = None,
    cold: bool = False,
    repeat: int = 3,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    host_budget: ram.HostBudget | None = ram.DEFAULT_HOST_BUDGET,
    kv_bits: int = 16,
    vs_resident: bool = False,
    experts: str = "routed",
    vs_all_experts: bool = False,
    batch: int = 0,
    ranks: int = 1,
) -> dict[str, object]:
    index = load_index(model)
    fixed = float(link_gbps) if link_gbps not in (None, "auto") else None
    engine = PrefillEngine(
        index, budget=budget, device=device, chunk_tokens=chunk_tokens, link_gbps=fixed,
        host_budget=host_budget,
    )  # fmt: skip
    engine.route_experts = experts == "routed"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, index.spec.vocab_size, tokens).tolist()
    before = (lambda: evict_page_cache(index)) if cold else (lambda: None)
    try:
        auto = link_gbps == "auto"
        phases = _phases(engine, ids, repeat, before, auto, fixed, kv_bits, vs_resident)
        if vs_all_experts:
            phases.side_by_side.update(_vs_all_experts(engine, ids, repeat, before))
        if batch > 1:
            phases.side_by_side.update(vs_lone(engine, batch, tokens, repeat, before))
        if ranks > 1:  # the ranks take the link `auto` found for this engine
            phases.side_by_side.update(vs_ranks(
                ranks, model, engine, lambda: _run(engine, ids).wall_s, ids, repeat, before,
                phases.link_gbps, host_budget,
            ))  # fmt: skip
    finally:
        engine.close()
    last = phases.last  # MoE: experts read in the last run, and the link's wait for routers
    moe = {"experts": experts, "experts_streamed": sum(last.experts_streamed.values())}
    moe["route_wait_s"] = last.route_wait_s
    return _result(phases, engine, index, budget, tokens, kv_bits, cold, repeat) | moe


def _phases(
    engine: PrefillEngine, ids: list[int], repeat: int, before: Callable[[], None],
    auto_link: bool, fixed: float | None, kv_bits: int, vs_resident: bool,
) -> _Phases:  # fmt: skip
    """The bench's phases in order: warm-up, compute only, (the auto link), load only,
    overlapped, (all resident), (quantizing for the wire)."""
    _run(engine, ids)  # warm-up: resident set, allocator, page cache (unless --cold)
    compute_s = _median(repeat, lambda: _run(engine, ids, synchronous=True).compute_busy_s, before)
    if auto_link:  # the link at which loading takes as long as computing
        per_pass = engine.stream_weights().bytes_streamed
        fixed = per_pass * 8 / compute_s / 1e9 if compute_s > 0 else None
        engine.streamer.mover.throttle.set(fixed)
    loaded: list[PrefillStats] = []

    def load_run() -> float:
        loaded.append(engine.stream_weights())
        return loaded[-1].wall_s

    load_s = _median(repeat, load_run, before)
    wall_s, walls, rss = _overlapped(engine, ids, repeat, before)
    side_by_side = _vs_resident(engine, ids, repeat, before) if vs_resident else {}
    quantize_s = None
    if kv_bits < 16:  # the wire's quantizing, timed inside the same overlapped runs
        fmt = KVFormat(kv_bits)
        quantize_s = _median(repeat, lambda: _run(engine, ids, kv_format=fmt).quantize_s, before)
    return _Phases(compute_s, load_s, wall_s, loaded, walls[-1], rss, fixed, quantize_s,
                   side_by_side)  # fmt: skip


def _overlapped(
    engine: PrefillEngine, ids: list[int], repeat: int, before: Callable[[], None]
) -> tuple[float, list[PrefillStats], list[int]]:
    """The real, overlapped prefill: (median wall seconds, each run's stats, each run's peak
    RSS over its start in bytes, -1 where the peak cannot be reset)."""
    rss: list[int] = []
    walls: list[PrefillStats] = []

    def wall_run() -> float:
        base = _rss()
        reset = _reset_peak_rss()
        stats = _run(engine, ids)
        rss.append(_peak_rss() - base if reset else -1)
        walls.append(stats)
        return stats.wall_s

    return _median(repeat, wall_run, before), walls, rss


def _result(
    p: _Phases, engine: PrefillEngine, index: ModelIndex, budget: int, tokens: int,
    kv_bits: int, cold: bool, repeat: int,
) -> dict[str, object]:  # fmt: skip
    """The bench's JSON keys (`tandem bench prefill --json`)."""
    last, wall_s, load_s, compute_s = p.last, p.wall_s, p.load_s, p.compute_s
    return {
        "wall_s": wall_s,
        "load_s": load_s,
        "compute_s": compute_s,
        "overlap_ratio": wall_s / max(load_s, compute_s),
        "sequential_ratio": wall_s / (load_s + compute_s),
        "peak_weight_bytes": last.peak_weight_bytes,
        "peak_activation_bytes": last.peak_activation_bytes,
        "peak_rss_delta_bytes": int(statistics.median(p.rss)),
        "budget_bytes": budget,
        "model_bytes": index.total_bytes,
        "bytes_streamed": last.bytes_streamed,
        "disk_bytes": last.disk_bytes,  # per pass, as the next two: where the bytes came from
        "ram_bytes": last.ram_bytes,
        "ram_tier_bytes": engine.plan.host_bytes,  # what the RAM tier holds
        # the loader's own rates, from the load-only runs: whether it runs near the link
        "disk_Bps": _rate([(s.disk_bytes, s.disk_s) for s in p.loaded]),
        "copy_Bps": (  # on a CPU the read lands in the slot: there is no separate copy
            _rate([(s.bytes_streamed, s.h2d_s) for s in p.loaded])
            if engine.device.type != "cpu"
            else None
        ),
        "loader_Bps": _rate([(s.bytes_streamed, s.load_busy_s) for s in p.loaded]),
        "pinned_bytes": last.pinned_bytes,
        "kv_bits": kv_bits,
        "quantize_s": p.quantize_s,
        "quantize_share": p.quantize_s / wall_s if p.quantize_s is not None else None,
        "tokens": tokens,
        "tokens_per_s": tokens / wall_s,
        "link_gbps": p.link_gbps,
        "device": str(engine.device),
        "cold": cold,
        "repeat": repeat,
        **p.side_by_side,
    }


def _vs_resident(
    engine: PrefillEngine, ids: list[int], repeat: int, before: Callable[[], None]
) -> dict[str, float]:
    """The same prompt through `engine` and through a second engine that keeps the whole
    model resident, run in turns (streamed, resident, streamed, ...) so that a slow spell of
    a shared machine weighs on both: `resident_wall_s` (median) and `vs_resident_ratio`, the
    median of each turn's streamed / resident wall."""
    resident = PrefillEngine(
        engine.index, device=engine.device, chunk_tokens=engine.chunk_tokens,
        max_prompt_tokens=engine.max_prompt_tokens,
    )  # fmt: skip
    try:
        if resident.plan.n_slots:
            raise ModelError(
                f"--vs resident: the model does not fit {engine.device} whole (a budget of"
                f" {resident.budget} B streams it)"
            )
        _run(resident, ids)  # warm-up: its weights are loaded once, here
        pairs = []
        for _ in range(repeat):
            before()
            streamed = _run(engine, ids).wall_s
            before()
            pairs.append((streamed, _run(resident, ids).wall_s))
    finally:
        resident.close()
    return {
        "resident_wall_s": statistics.median([r for _, r in pairs]),
        "vs_resident_ratio": statistics.median([s / r for s, r in pairs]),
    }


def _vs_all_experts(
    engine: PrefillEngine, ids: list[int], repeat: int, before: Callable[[], None]
) -> dict[str, float]:
    """The same prompt with every expert read (no router waited for), in turns with the routed
    runs on the same engine: `all_experts_wall_s` (median), `vs_all_experts_ratio` (the median
    of each turn's routed / all-experts wall) and the bytes each streamed."""
    if not any(ld.routed and not ld.resident for ld in engine.plan.loads):
        raise ModelError("--vs all-experts: this plan streams no experts (no MoE layer streamed)")
    routed, turns = engine.route_experts, []
    try:
        for _ in range(repeat):
            before()
            engine.route_experts = routed
            chosen = _run(engine, ids)
            before()
            engine.route_experts = False
            turns.append((chosen, _run(engine, ids)))
    finally:
        engine.route_experts = routed
    return {
        "all_experts_wall_s": statistics.median(every.wall_s for _, every in turns),
        "all_experts_bytes": turns[-1][1].bytes_streamed,
        "routed_bytes": turns[-1][0].bytes_streamed,
        "vs_all_experts_ratio": statistics.median(c.wall_s / e.wall_s for c, e in turns),
    }


def vs_accelerate(model: Path, tokens: int, budget: int, device: str | None) -> dict[str, float]:
    """The same prompt through transformers + accelerate offload, in a fresh process."""
    cmd = [sys.executable, "-m", "tandem.nodes.prefill.measure.vs_accelerate", str(model),
           str(tokens), str(budget), device or ""]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"accelerate run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_random_model(spec: str, out: Path, dtype: str) -> Path:
    """`LAYERSxHIDDEN` → a random Llama-shaped model (no tokenizer needed)."""
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    layers, hidden = (int(x) for x in spec.lower().split("x"))
    heads = max(1, hidden // 128)
    args = MakeModelArgs(
        layers=layers, hidden=hidden, heads=heads, kv_heads=max(1, heads // 4),
        intermediate=int(hidden * 3.5) // 64 * 64, vocab=4096, dtype=dtype,  # type: ignore[arg-type]
        shards=min(4, layers),
    )  # fmt: skip
    return make_model(out, args, with_tokenizer=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench prefill", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="ID|DIR", help="a directory, or an id found offline")
    src.add_argument("--random", metavar="LAYERSxHIDDEN", help="bench a fresh random model")
    p.add_argument("--models-dir", type=Path, action="append", default=[], metavar="DIR",
                   help="also look for a model id as DIR/org/name or DIR/name")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--budget", type=parse_size, required=True)
    p.add_argument("--host-budget", type=ram.host_budget_arg, default=ram.DEFAULT_HOST_BUDGET,
                   help=ram.HOST_BUDGET_HELP)  # fmt: skip
    p.add_argument("--link-gbps", default=None, help="Gbit/s, or 'auto': load_s ≈ compute_s")
    p.add_argument("--device", choices=["cuda", "mps", "cpu"], default=None)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--cold", action="store_true", help="evict the page cache before each phase")
    p.add_argument("--vs", choices=["accelerate", "resident", "all-experts"], default=None,
                   help="also run the prompt through accelerate's offload, (resident) through a"
                   " second engine holding the whole model, turn by turn, or (all-experts, MoE)"
                   " with every expert read, turn by turn with the routed runs")  # fmt: skip
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=16,
                   help="also time quantizing K/V for the wire")  # fmt: skip
    p.add_argument("--experts", choices=["routed", "all"], default="routed",
                   help="MoE: read only the chosen experts (default), or all of them")  # fmt: skip
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="also N prompts in one pass against N lone ones (batch_ratio)")  # fmt: skip
    p.add_argument("--ranks", type=int, default=1, metavar="N", help="also N ranks (ranks_ratio)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        a.link_gbps = a.link_gbps if a.link_gbps in (None, "auto") else float(a.link_gbps)
    except ValueError:
        print("--link-gbps takes a number or 'auto'", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
            model = (locate(a.model, a.models_dir) if a.model
                     else make_random_model(a.random, Path(tmp) / "model", a.dtype))  # fmt: skip
            result = bench(
                model, a.tokens, a.budget, a.link_gbps, a.device, a.cold, a.repeat,
                a.chunk_tokens, a.host_budget, a.kv_bits, a.vs == "resident", a.experts,
                vs_all_experts=a.vs == "all-experts", batch=a.batch, ranks=a.ranks,
            )  # fmt: skip
            if a.vs == "accelerate":
                other = vs_accelerate(model, a.tokens, a.budget, a.device)
                result["accelerate_wall_s"] = other["wall_s"]
                result["accelerate_peak_rss_delta_bytes"] = other["peak_rss_delta_bytes"]
    except (ModelError, RuntimeError, ValueError) as e:
        print(f"tandem bench prefill: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else table(result) + table_lines(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
