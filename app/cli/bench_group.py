"""`tandem bench group MODEL`: a decode group's speed (nodes/decode/group/bench.py). Run it
under `mlx.launch -n N --backend ring -- tandem bench group MODEL`; alone it is one rank."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from tandem.app.cli.args import MODEL_HELP, add_models_dir_argument, model_path

log = logging.getLogger("tandem")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench group", description=__doc__)
    p.add_argument("model", metavar="ID|DIR", help=MODEL_HELP)
    add_models_dir_argument(p)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--split", default=None, help="layers per rank, rank 0 first: e.g. 3,1")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return p


def main(argv: Sequence[str]) -> int:
    a = build_parser().parse_args(argv)
    from tandem.nodes.decode.group.bench import bench
    from tandem.nodes.decode.group.pipeline import GroupError

    split = [int(n) for n in a.split.split(",")] if a.split else None
    try:
        report = bench(model_path(a.model, a.models_dir), a.prompt_tokens, a.tokens, split)
    except (GroupError, ValueError, OSError) as e:
        log.error("tandem bench group: %s", e)
        return 2
    if report is None:  # not rank 0
        return 0
    if a.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    lines = [f"group of {report['size']}: TTFT {report['ttft_s'] * 1e3:.1f} ms, "
             f"{report['decode_tok_s']:.1f} tok/s, {report['step_bytes_sent']} B between "
             "ranks a step"]  # fmt: skip
    for r in report["ranks"]:
        first, end = r["layers"]
        lines.append(f"  rank {r['rank']} {r['host']}: layers {first}..{end - 1}, "
                     f"{r['weight_bytes'] / 2**20:.1f} MiB of weights")  # fmt: skip
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
