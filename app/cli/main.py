"""The `tandem` command line: the parser and the dispatch. Each command is a module with an
`add_parser(sub)` that sets its handler as `func`; heavy frameworks (torch, mlx, textual) are
imported inside the handler that needs them, so `tandem --help` and a decode-only machine
never load torch."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from tandem.app.cli import (
    bench,
    demo,
    make_model,
    models_cmd,
    node,
    pair_cmd,
    plan_cmd,
    prefill,
    pull_cmd,
    real_model,
)
from tandem.app.cli.errors import UsageError
from tandem.app.tui.command import add_tui_parser
from tandem.nodes.model.errors import ModelError

# in the order `tandem --help` lists them
ADDERS: list[Callable[[argparse._SubParsersAction], None]] = [
    make_model.add_parser,
    prefill.add_parser,
    node.add_parser,
    bench.add_parser,
    plan_cmd.add_parser,
    models_cmd.add_parser,
    pull_cmd.add_parser,
    pair_cmd.add_parser,
    demo.add_parser,
    real_model.add_parser,
    add_tui_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Layer-streamed GPU prefill + mlx-lm decode across machines."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in ADDERS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the command's handler; bad input is one line on stderr and exit status 2."""
    parser = build_parser()
    a = parser.parse_args(argv)
    level = logging.DEBUG if a.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(a.func(a) or 0)
    except (ModelError, UsageError) as e:
        print(f"tandem {a.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
