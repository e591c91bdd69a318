"""`tandem tui [--peer URL]... [--token-file F] [--no-mdns]`: the dashboard.

Textual is imported when the command runs, not when the CLI starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_tui_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tui", help="the dashboard: nodes, layer pipeline, bandwidth, chat")
    p.add_argument(
        "--peer", action="append", default=[], metavar="URL", help="a node to watch (repeat)"
    )
    p.add_argument("--token-file", type=Path, default=None, help="or env TANDEM_TOKEN")
    p.add_argument("--no-mdns", action="store_true", help="only the --peer nodes and theirs")
    p.set_defaults(func=cmd_tui)


def cmd_tui(a: argparse.Namespace) -> int:
    from tandem.app.cli.errors import UsageError
    from tandem.app.paths import config_dir
    from tandem.nodes.trust.auth import AuthError, load_token

    try:
        token = load_token(a.token_file, config_dir() / "token")
    except AuthError as e:
        raise UsageError(str(e)) from None
    if not a.peer and a.no_mdns:
        raise UsageError("give a node with --peer URL, or allow mDNS discovery")
    return run_tui(a.peer, token, mdns=not a.no_mdns)


def run_tui(peers: list[str], token: str | None, mdns: bool = True) -> int:
    """Run the dashboard until the user quits."""
    from tandem.app.tui.app import TandemApp

    TandemApp(peers, token, mdns=mdns).run()
    return 0
