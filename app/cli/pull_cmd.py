"""`tandem pull ORG/NAME [--revision R]`: download a model into the Hugging Face cache, only
the files it needs (mlx-lm's own patterns: configs, `model*.safetensors`, the tokenizer), with
huggingface_hub's progress bars; an interrupted pull resumes where it stopped (the hub's own
`.incomplete` files). Then `--model ORG/NAME` finds it offline, on this machine and, with the
same cache, mlx-lm's."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from tandem.app.cli.errors import UsageError
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.locate import MLX_LM_PATTERNS, hub_cache_dir, source_of

log = logging.getLogger("tandem")
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # as huggingface_hub reads them


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a model by id into the Hugging Face cache")
    p.add_argument("id", metavar="ORG/NAME[@REVISION]")
    p.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    p.set_defaults(func=run)


def offline() -> bool:
    """Whether the environment says offline now (huggingface_hub reads it once, at import)."""
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in OFFLINE_ENV)


def pull(repo_id: str, revision: str | None) -> Path:
    """The snapshot directory once downloaded (or found complete); UsageError, one line, when
    offline or the Hub refuses."""
    cache = hub_cache_dir()
    if offline():
        raise UsageError(
            f"offline (HF_HUB_OFFLINE is set): cannot download {repo_id}; unset it, or name a "
            "model already here (`tandem models`)"
        )
    from huggingface_hub import errors, snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=list(MLX_LM_PATTERNS)
            )
        )
    except errors.LocalEntryNotFoundError as e:  # the Hub unreachable, the files not here
        cause = type(e.__cause__).__name__ if e.__cause__ is not None else "no network"
        raise UsageError(
            f"offline: the Hugging Face Hub cannot be reached ({cause}) and {repo_id} is not "
            f"in {cache}"
        ) from None
    except errors.RepositoryNotFoundError:  # also gated or private without a token
        raise UsageError(
            f"{repo_id}: no such model on the Hugging Face Hub, or it is private or gated "
            "(`hf auth login` gives a token)"
        ) from None
    except errors.RevisionNotFoundError:
        raise UsageError(f"{repo_id}: no revision {revision!r} on the Hugging Face Hub") from None
    except errors.HFValidationError as e:
        raise UsageError(f"{repo_id}: not a model id ({e})") from None
    except errors.HfHubHTTPError as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{repo_id}: the Hugging Face Hub answered {first}") from None
    except OSError as e:  # the disk: full, read-only
        raise UsageError(f"{cache}: {e.strerror or e}") from None


def run(a: argparse.Namespace) -> int:
    """Pull, then say where it landed and whether tandem can serve it."""
    from tandem.nodes.model.spec import load_spec

    repo_id, _, at = a.id.partition("@")
    if repo_id.count("/") != 1:
        raise UsageError(f"{a.id}: a model id is org/name")
    path = pull(repo_id, a.revision or at or None)
    print(path)
    log.info("pulled %s", source_of(path).describe())
    try:
        spec = load_spec(path)
    except ModelError as e:
        log.warning("%s is here, but tandem cannot serve it: %s", repo_id, e)
        return 0
    log.info("%s: %s, %d layers; `tandem node --model %s` serves it", repo_id, spec.family,
             spec.num_layers, a.id)  # fmt: skip
    return 0
