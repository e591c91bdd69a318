"""Argument types and help shared by more than one command."""

from __future__ import annotations

import argparse

from tandem.nodes.contract.units import parse_size

MAX_PROMPT_HELP = "longest prompt: its activations are kept free in --budget (cuda: 8192)"


def size(text: str) -> int:
    """`--budget 512MiB` and the like: bytes, or argparse's one-line error."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
