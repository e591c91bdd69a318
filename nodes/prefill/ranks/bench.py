"""The ranks of `tandem bench prefill --ranks N`, run by torch's launcher
(`measure/bench_ranks.py` builds the command):

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m tandem.nodes.prefill.ranks.bench OUT MODEL PROMPT --budget BYTES [--link-gbps G] ...

Each rank builds an engine of its share of every layer (`collective.py`) on its own device and
its own throttled link; rank 0 prefills PROMPT (a JSON list of token ids: a warm-up pass, then
a pass per turn) while the others follow (`follower.py`). With `--turns PORT`, rank 0 runs a
pass each time the bench on 127.0.0.1:PORT sends a line, answers a line once it is done, and
stops when the bench closes the connection, so that the bench's one-device passes and the
ranks' take turns; without it, `--repeat` passes. Rank 0 then writes to OUT, as JSON:

    {"world": N, "backend": "gloo", "layers": L, "ranks": [PrefillRank.to_json(), ...],
     "passes": [{"wall_s": rank 0's pass, "records": [PassRecord of each rank]}, ...]}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tandem.nodes.contract.units import parse_size
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning import ram
from tandem.nodes.prefill.ranks.collective import Collective, rank_device, world_from_env
from tandem.nodes.prefill.ranks.follower import follow
from torch.distributed.elastic.multiprocessing.errors import record


def _turns(port: int | None, repeat: int) -> Iterator[None]:
    """One item per pass: each line the bench sends (answered once the pass is done), or
    `repeat` of them without a bench."""
    if port is None:
        yield from (None for _ in range(repeat))
        return
    with socket.create_connection(("127.0.0.1", port)) as sock, sock.makefile("rwb") as f:
        while f.readline():
            yield None
            f.write(b"\n")
            f.flush()


def _passes(engine: PrefillEngine, ids: list[int], turns: Iterator[None]) -> list[dict[str, Any]]:
    """Rank 0: a warm-up pass (the resident sets), then a pass per turn, each rank's record."""
    c = engine.collective
    assert c is not None and c.rank == 0
    for _ in engine.prefill(ids):
        pass
    passes = []
    for _ in turns:
        t0 = time.perf_counter()
        for _ in engine.prefill(ids):
            pass
        wall_s = engine.last_stats.wall_s  # timed as the bench times one device's
        if engine.device.type == "cuda":  # the last layer's MLP still runs once its K/V are out
            torch.cuda.synchronize(engine.device)
            wall_s = max(wall_s, time.perf_counter() - t0)
        records = [dataclasses.asdict(r) for r in c.records]
        passes.append({"wall_s": wall_s, "records": records})
    return passes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tandem.nodes.prefill.ranks.bench",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("out", type=Path, help="rank 0 writes the passes here (JSON)")
    p.add_argument("model", type=Path)
    p.add_argument("prompt", type=Path, help="a JSON list of token ids")
    p.add_argument("--budget", type=parse_size, required=True, help="each rank's")
    p.add_argument("--link-gbps", type=float, default=None, help="each rank's own link")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--host-budget", type=ram.host_budget_arg, default=ram.DEFAULT_HOST_BUDGET)
    p.add_argument("--repeat", type=int, default=3, help="passes, without --turns")
    p.add_argument("--turns", type=int, default=None, metavar="PORT",
                   help="a pass each time the bench on this port asks")  # fmt: skip
    return p


@record  # a rank's exception in the launcher's report, which ends its output
def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    world = world_from_env()
    if world is None:
        print("run under torch.distributed.run with 2 ranks or more", file=sys.stderr)
        return 2
    rank, size, local = world
    device = rank_device(a.device, local)
    c = Collective.start(rank, size, torch.device(device))
    try:
        engine = PrefillEngine(
            a.model, budget=a.budget, device=device, chunk_tokens=a.chunk_tokens,
            link_gbps=a.link_gbps, host_budget=a.host_budget, collective=c,
        )  # fmt: skip
        try:
            _rank(a, engine)
        finally:
            engine.close()  # (rank 0: the others' `follow` returns)
    finally:
        c.close()
    return 0


def _rank(a: argparse.Namespace, engine: PrefillEngine) -> None:
    """Rank 0 runs the passes and writes them to `a.out`; the others follow it."""
    c = engine.collective
    assert c is not None
    c.describe(engine, a.link_gbps)
    if c.rank:
        follow(engine)
        return
    ids = json.loads(a.prompt.read_text())
    with contextlib.closing(_turns(a.turns, a.repeat)) as turns:
        passes = _passes(engine, ids, turns)
    out = {"world": c.shard.world, "backend": dist.get_backend(),
           "layers": engine.spec.num_layers, "ranks": [r.to_json() for r in c.described],
           "passes": passes}  # fmt: skip
    a.out.write_text(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
