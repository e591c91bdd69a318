"""`tandem bench prefill|e2e|verify|group|serve ...`: the benchmarks, each its own arguments."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: `bench prefill ...`, `bench e2e ...`, `bench verify MODEL`, "
        "`bench group MODEL` (under mlx.launch), `bench serve ...` (many chats at once)",
    )
    p.add_argument("which", choices=["prefill", "e2e", "verify", "group", "serve"])
    p.add_argument("args", nargs=argparse.REMAINDER, help="see `tandem bench WHICH --help`")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """Hand the rest of the command line to the benchmark's own parser."""
    if a.which == "prefill":
        from tandem.nodes.prefill.measure.bench import main as bench_prefill

        return bench_prefill(a.args)
    if a.which == "verify":
        from tandem.app.cli.bench_verify import main as bench_verify

        return bench_verify(a.args)
    if a.which == "serve":
        from tandem.app.cli.bench_serve import main as bench_serve

        return bench_serve(a.args)
    if a.which == "group":
        from tandem.app.cli.bench_group import main as bench_group

        return bench_group(a.args)
    from tandem.app.cli.bench_e2e import main as bench_e2e

    return bench_e2e(a.args)
