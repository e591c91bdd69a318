"""`tandem pair [--set TOKEN | --check URL [--verify-weights MODEL]]`: create, store or check
the cluster token (the token itself and the check are `pair.py`'s); with `--verify-weights`,
the check also reads every tensor of this machine's model (as `tandem node --verify-weights`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.app.cli.errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pair", help="create, store or check the cluster token")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--set", metavar="TOKEN", help="store TOKEN (printed by `tandem pair`)")
    g.add_argument("--check", metavar="URL", help="does the node at URL hold our token?")
    p.add_argument(
        "--verify-weights", type=Path, default=None, metavar="MODEL",
        help="with --check: also read every tensor of this machine's model: a sha256 each, "
        "no NaN/Inf (cached by size, mtime)",
    )  # fmt: skip
    p.add_argument("--token-file", type=Path, default=None)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """Store the given token, check a node against ours, or print ours (made if new)."""
    from tandem.app.cli.pair import ensure_token, pair_text, run_check, store_token, token_path
    from tandem.nodes.trust.auth import AuthError, load_token

    if a.verify_weights is not None and a.check is None:
        raise UsageError("--verify-weights goes with --check URL")
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
        if a.verify_weights is not None:
            print(_verified_text(a.verify_weights))
        ok, text = run_check(a.check, token)
        print(text)
        return 0 if ok else 1
    token, created = ensure_token()
    print(pair_text(token, created))
    return 0


def _verified_text(model: Path) -> str:
    """One line on the local model's weights; a ModelError (exit 2) names a bad tensor."""
    from tandem.app.cli.node import verify_model

    v = verify_model(model)
    how = "unchanged since verified" if not v.read_bytes else f"read at {v.rate / 1e9:.2f} GB/s"
    return (
        f"{model}: {v.tensors} tensors, {v.nbytes / 1e9:.2f} GB, all finite ({how}); "
        f"weights sha256 {v.digest}"
    )
