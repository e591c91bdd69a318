"""Argument types and help shared by more than one command."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from tandem.nodes.contract.units import parse_size

log = logging.getLogger("tandem")

MAX_PROMPT_HELP = "longest prompt: its activations are kept free in --budget (cuda: 8192)"


def size(text: str) -> int:
    """`--budget 512MiB` and the like: bytes, or argparse's one-line error."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


MODEL_HELP = (
    "a model directory, or an id (org/name[@revision]) found offline in the Hugging Face "
    "cache, LM Studio's models, --models-dir or $TANDEM_MODELS (`tandem models` lists them)"
)


def add_model_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    """`--model ID|DIR` and `--models-dir DIR` (repeatable); `model_path` resolves them."""
    p.add_argument("--model", required=required, metavar="ID|DIR", help=MODEL_HELP)
    add_models_dir_argument(p)


def add_models_dir_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models-dir", type=Path, action="append", default=[], metavar="DIR",
        help="also look for a model id as DIR/org/name or DIR/name (repeatable)",
    )  # fmt: skip


def model_path(name_or_path: str | Path, models_dirs: Sequence[Path] = ()) -> Path:
    """The model directory `--model` names; a ModelError (one line, exit 2) where none is."""
    from tandem.nodes.model.locate import find_model

    source = find_model(name_or_path, models_dirs)
    if source.where != "directory":
        log.info("model %s: %s", name_or_path, source.describe())
    return source.path
