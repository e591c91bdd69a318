"""Where the model named by `--model` lives: a directory, or an id found in the caches users
already have, offline.

`find_model(name_or_path, models_dirs)` tries, in order:

1. an existing directory (a path keeps path semantics: a missing one is an error, never an id);
2. `org/name[@revision]` in the Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`,
   else `~/.cache/huggingface/hub`), through huggingface_hub's own offline look-up
   (`snapshot_download(local_files_only=True)`), with mlx-lm's file patterns;
3. `org/name` in LM Studio's models folder (`~/.lmstudio/models/org/name`; LM Studio moves its
   home by the path in `~/.lmstudio-home-pointer`; the older `~/.cache/lm-studio/models` too);
4. `<dir>/org/name` or `<dir>/name` in each `--models-dir`, then each `TANDEM_MODELS` folder
   (os.pathsep-separated).

A miss is one ModelError naming the id and every place looked. Nothing here touches the
network: `tandem pull` downloads. huggingface_hub is imported only when an id is looked up, so a
bare GPU box without it still takes directory paths.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tandem.nodes.model.errors import ModelError

log = logging.getLogger(__name__)

# what mlx-lm's `load` downloads (mlx_lm/utils.py `_download`): the files a model needs
MLX_LM_PATTERNS = (
    "*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
    "*.txt", "*.jsonl", "*.jinja",
)  # fmt: skip
MODELS_ENV = "TANDEM_MODELS"
_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_REPO_PREFIX = "models--"  # the hub cache's folder per model repo: models--org--name

Where = Literal["directory", "hf-cache", "lmstudio", "models-dir"]


@dataclass(frozen=True)
class ModelSource:
    """A model found on this machine: its directory, where it was found, the id it was found
    by ("" for a directory path), and its Hugging Face snapshot revision ("" outside the
    hub's cache)."""

    path: Path
    where: Where
    id: str = ""
    revision: str = ""

    def describe(self) -> str:
        """One line for logs and listings."""
        if self.where == "hf-cache":
            return f"{self.id}@{self.revision[:12]} in the Hugging Face cache ({self.path})"
        if self.where == "lmstudio":
            return f"{self.id} in LM Studio's models ({self.path})"
        if self.where == "models-dir":
            return f"{self.id} in {self.path}"
        return f"local directory {self.path}"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub resolves it, from the environment now
    (its own constants are read once, at its import)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        cache = os.path.join(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface"), "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def lmstudio_models_dirs() -> list[Path]:
    """LM Studio's models folders: its home's (the path in `~/.lmstudio-home-pointer`, else
    `~/.lmstudio`), then the older `~/.cache/lm-studio/models` where it exists."""
    home = Path.home()
    base = home / ".lmstudio"
    pointer = home / ".lmstudio-home-pointer"
    if pointer.is_file():
        try:
            base = Path(pointer.read_text(encoding="utf-8").strip()).expanduser() or base
        except (OSError, UnicodeDecodeError) as e:
            log.warning("%s: %s; using %s", pointer, e, base)
    legacy = home / ".cache" / "lm-studio" / "models"
    return [base / "models", *([legacy] if legacy.is_dir() else [])]


def search_dirs(extra: Sequence[Path] = ()) -> list[Path]:
    """`--models-dir` folders, then `TANDEM_MODELS`'s."""
    listed = [p for p in os.environ.get(MODELS_ENV, "").split(os.pathsep) if p]
    return [Path(p).expanduser() for p in (*map(str, extra), *listed)]


def hub_snapshot(path: Path) -> tuple[str, str] | None:
    """(`org/name`, revision) when `path` is a snapshot in a hub cache
    (`models--org--name/snapshots/<rev>`), else None."""
    parts = path.absolute().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith(_REPO_PREFIX):
        return None
    return parts[-3][len(_REPO_PREFIX) :].replace("--", "/"), parts[-1]


def model_name(path: Path) -> str:
    """What a model is called: `org/name` for a hub snapshot (its folder is a commit hash),
    else its directory's name."""
    snapshot = hub_snapshot(path)
    return snapshot[0] if snapshot else path.name


def source_of(path: Path) -> ModelSource:
    """A directory given by path, with the hub's id and revision when it is a snapshot."""
    snapshot = hub_snapshot(path)
    if snapshot is None:
        return ModelSource(path, "directory")
    return ModelSource(path, "hf-cache", *snapshot)


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text


def locate(name_or_path: str | Path, models_dirs: Sequence[Path] = ()) -> Path:
    """The directory of the model named by `name_or_path` (see the module docstring)."""
    return find_model(name_or_path, models_dirs).path


def find_model(name_or_path: str | Path, models_dirs: Sequence[Path] = ()) -> ModelSource:
    """Where the model named by `name_or_path` is: a directory path, else an id looked up
    offline. ModelError, one line, for a missing path or an id found nowhere."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return source_of(path)
    if path.exists():
        raise ModelError(f"{text}: not a model directory")
    if isinstance(name_or_path, Path) or _looks_like_path(text):
        raise ModelError(f"{text}: no such model directory")
    repo_id, at, revision = text.partition("@")
    if not _ID.fullmatch(repo_id) or (at and not revision):
        raise ModelError(f"{text}: neither a model directory nor a model id (org/name[@revision])")
    looked: list[str] = []
    if "/" in repo_id:
        found = _in_hub_cache(repo_id, revision or None, looked)
        if found is not None:
            return found
    if not revision:  # a revision is the hub cache's alone
        found = _in_folders(repo_id, models_dirs, looked)
        if found is not None:
            return found
    if not looked:  # a bare name, and no models folder to look in
        raise ModelError(
            f"{text}: no such model directory (a bare name is looked up only in --models-dir "
            f"and ${MODELS_ENV}; a Hugging Face id is org/name)"
        )
    if not revision and not search_dirs(models_dirs):
        looked.append(f"no --models-dir or ${MODELS_ENV}")
    hint = f"; `tandem pull {text}` downloads it" if "/" in repo_id else ""
    raise ModelError(f"model {text} not found: looked in {'; '.join(looked)}{hint}")


def _in_hub_cache(repo_id: str, revision: str | None, looked: list[str]) -> ModelSource | None:
    cache = hub_cache_dir()
    looked.append(f"the Hugging Face cache ({cache / (_REPO_PREFIX + repo_id.replace('/', '--'))})")
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        looked[-1] += " [huggingface_hub is not installed]"
        return None
    try:
        found = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True,
            allow_patterns=list(MLX_LM_PATTERNS),
        )  # fmt: skip
    except errors.LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x says so
            raise ModelError(
                f"{repo_id}: its download in {cache} is incomplete; `tandem pull {repo_id}` "
                "finishes it"
            ) from None
        return None
    except errors.HFValidationError:
        return None
    path = Path(found)
    return ModelSource(path, "hf-cache", repo_id, path.name)


def _in_folders(repo_id: str, extra: Sequence[Path], looked: list[str]) -> ModelSource | None:
    short = repo_id.rsplit("/", 1)[-1]
    places: list[tuple[Path, Where]] = []
    if "/" in repo_id:
        places += [(d / repo_id, "lmstudio") for d in lmstudio_models_dirs()]
    for d in search_dirs(extra):
        places += [(d / repo_id, "models-dir")]
        if short != repo_id:
            places += [(d / short, "models-dir")]
    for candidate, where in places:
        looked.append(f"LM Studio ({candidate})" if where == "lmstudio" else str(candidate))
        if candidate.is_dir():
            return ModelSource(candidate, where, repo_id)
    return None
