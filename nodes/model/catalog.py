"""The models on this machine, wherever `locate` would find them (`tandem models`): each
snapshot in the Hugging Face cache (huggingface_hub's `scan_cache_dir`), each
`publisher/model` folder in LM Studio's models, and each model in the `--models-dir` and
`TANDEM_MODELS` folders (`<dir>/name` holding files, else `<dir>/org/name`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.nodes.model.locate import (
    ModelSource,
    hub_cache_dir,
    lmstudio_models_dirs,
    search_dirs,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Installed:
    """One model found on disk and the bytes it takes there (blobs shared between a hub
    repo's revisions count once per revision)."""

    source: ModelSource
    size_bytes: int


def installed(extra: Sequence[Path] = ()) -> list[Installed]:
    """Every model in the hub cache, LM Studio's folders and the models folders, in that
    order (`extra`: `--models-dir` folders)."""
    return [*_hub(), *_lmstudio(), *_folders(extra)]


def dir_size(path: Path) -> int:
    """Bytes of the files under `path`, a link counted as what it points to."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(top) / name).stat().st_size
            except OSError:  # a dangling link: a blob not downloaded (yet)
                continue
    return total


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _holds_files(path: Path) -> bool:
    try:
        return any(p.is_file() for p in path.iterdir())
    except OSError:
        return False


def _hub() -> Iterator[Installed]:
    cache = hub_cache_dir()
    if not cache.is_dir():
        return
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:
        log.warning("huggingface_hub is not installed: the Hugging Face cache is not listed")
        return
    info = scan_cache_dir(cache)
    for warning in info.warnings:  # a corrupted repo folder: skipped, said once
        log.warning("%s", warning)
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified):
            source = ModelSource(rev.snapshot_path, "hf-cache", repo.repo_id, rev.commit_hash)
            yield Installed(source, rev.size_on_disk)


def _lmstudio() -> Iterator[Installed]:
    for root in lmstudio_models_dirs():
        for publisher in _subdirs(root):
            for model in filter(_holds_files, _subdirs(publisher)):
                source = ModelSource(model, "lmstudio", f"{publisher.name}/{model.name}")
                yield Installed(source, dir_size(model))


def _folders(extra: Sequence[Path]) -> Iterator[Installed]:
    for root in search_dirs(extra):
        for child in _subdirs(root):
            if _holds_files(child):
                yield Installed(ModelSource(child, "models-dir", child.name), dir_size(child))
                continue
            for model in filter(_holds_files, _subdirs(child)):
                source = ModelSource(model, "models-dir", f"{child.name}/{model.name}")
                yield Installed(source, dir_size(model))
