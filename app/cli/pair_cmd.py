"""`tandem pair [--set TOKEN | --check URL]`: create, store or check the cluster token (the
token itself and the check are `pair.py`'s)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.app.cli.errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pair", help="create, store or check the cluster token")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--set", metavar="TOKEN", help="store TOKEN (printed by `tandem pair`)")
    g.add_argument("--check", metavar="URL", help="does the node at URL hold our token?")
    p.add_argument("--token-file", type=Path, default=None)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """Store the given token, check a node against ours, or print ours (made if new)."""
    from tandem.app.cli.pair import ensure_token, pair_text, run_check, store_token, token_path
    from tandem.nodes.trust.auth import AuthError, load_token

    if a.set is not None:
        if len(a.set.strip()) < 16:
            raise UsageError("that token is too short to be one `tandem pair` made")
        print(f"Stored the cluster token in {store_token(a.set.strip(), a.token_file)}")
        return 0
    if a.check is not None:
        try:
            token = load_token(a.token_file, token_path())
        except AuthError as e:
            raise UsageError(str(e)) from None
        if token is None:
            raise UsageError("no token here yet: run `tandem pair` (or `tandem pair --set`)")
        ok, text = run_check(a.check, token)
        print(text)
        return 0 if ok else 1
    token, created = ensure_token()
    print(pair_text(token, created))
    return 0
