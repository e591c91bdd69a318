"""`tandem bench verify MODEL`: how fast `--verify-weights` reads a model, three ways.

- `cold_Bps`: the model's files dropped from the page cache first (posix_fadvise DONTNEED,
  no root needed), so the disk is read;
- `warm_Bps`: right after, the files in the page cache: the hashing and finite checks alone;
- `cached_s`: a second run with the cache file the first one wrote: only stats and JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tandem.app.cli.args import MODEL_HELP, add_models_dir_argument, model_path
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import load_index
from tandem.nodes.model.page_cache import evict_page_cache
from tandem.nodes.model.verify import verify_weights


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench verify", description=__doc__)
    p.add_argument("model", metavar="ID|DIR", help=MODEL_HELP)
    add_models_dir_argument(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return p


def bench(model: Path) -> dict[str, float]:
    """Cold, warm and cached runs of the verification of `model`, with a throwaway cache."""
    index = load_index(model)
    evict_page_cache(index)
    cold = verify_weights(index)
    warm = verify_weights(index)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-verify-") as tmp:
        cache = Path(tmp) / "verified.json"
        verify_weights(index, cache)
        cached = verify_weights(index, cache)
    return {
        "bytes": float(cold.nbytes),
        "tensors": float(cold.tensors),
        "cold_s": cold.seconds,
        "cold_Bps": cold.rate,  # bytes/s
        "warm_s": warm.seconds,
        "warm_Bps": warm.rate,
        "cached_s": cached.seconds,
    }


def table(r: dict[str, float]) -> str:
    return "\n".join([
        f"model       {r['bytes'] / 1e9:.2f} GB in {int(r['tensors'])} tensors",
        f"cold        {r['cold_s']:.2f} s  {r['cold_Bps'] / 1e9:.2f} GB/s (page cache dropped)",
        f"warm        {r['warm_s']:.2f} s  {r['warm_Bps'] / 1e9:.2f} GB/s (in the page cache)",
        f"cached      {r['cached_s'] * 1e3:.1f} ms (unchanged files: size and mtime only)",
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        result = bench(model_path(a.model, a.models_dir))
    except ModelError as e:
        print(f"tandem bench verify: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else table(result))
    return 0
