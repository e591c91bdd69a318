"""`tandem models`: the models on this machine that `--model ID` can name (the Hugging Face
cache, LM Studio's models, `--models-dir` and `$TANDEM_MODELS`), each with its family, size on
disk, quantization, and whether tandem can serve it (else the one-line reason)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.app.cli.args import add_models_dir_argument
from tandem.nodes.contract.units import format_bytes
from tandem.nodes.model.catalog import Installed, installed
from tandem.nodes.model.errors import ModelError

WHERE = {"hf-cache": "hf", "lmstudio": "lmstudio", "models-dir": "dir", "directory": "dir"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models", help="the models here (Hugging Face cache, LM Studio, --models-dir) by id"
    )
    add_models_dir_argument(p)
    p.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Quantization:
    bits: int
    mode: str  # "affine", "mxfp4", ...
    group_size: int
    mixed: bool  # some modules stored otherwise (mlx-lm's mixed recipes, float routers)


@dataclass(frozen=True)
class ModelRow:
    id: str
    where: str  # "hf-cache", "lmstudio", "models-dir"
    path: str
    revision: str  # the Hugging Face snapshot's commit; "" elsewhere
    size_bytes: int
    family: str  # config.json's model_type; "" where there is none
    dtype: str  # config.json's torch_dtype
    quantization: Quantization | None  # None: float weights
    supported: bool
    why: str  # "" when supported; else the ModelError's message


def row(item: Installed) -> ModelRow:
    """One model's row: its spec read (config.json) and its tensor headers checked."""
    from tandem.nodes.model.index import load_index

    s = item.source
    family, dtype, quant, why = _config_family(s.path), "", None, ""
    try:
        spec = load_index(s.path).spec
        family, dtype = spec.family, spec.torch_dtype
        q = spec.quantization
        if q.default is not None:
            mixed = any(o != q.default for o in q.overrides.values()) or bool(q.floats)
            quant = Quantization(q.default.bits, q.default.mode, q.default.group_size, mixed)
    except (ModelError, OSError) as e:
        why = " ".join(str(e).split())  # one line
    return ModelRow(s.id, s.where, str(s.path), s.revision, item.size_bytes, family, dtype,
                    quant, not why, why)  # fmt: skip


def _config_family(path: Path) -> str:
    """config.json's model_type as written, for a model tandem cannot read (say which)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def _quant_text(r: ModelRow) -> str:
    q = r.quantization
    if q is None:
        return r.dtype or "-"
    return f"{q.bits}-bit {q.mode}{' mixed' if q.mixed else ''}"


def render(rows: list[ModelRow]) -> str:
    if not rows:
        return "no models found (`tandem pull ORG/NAME` downloads one)"
    head = ("ID", "FAMILY", "QUANT", "SIZE", "FROM", "SUPPORTED")
    table = [head] + [
        (r.id, r.family or "?", _quant_text(r), format_bytes(r.size_bytes),
         WHERE.get(r.where, r.where), "yes" if r.supported else f"no: {r.why}")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(line[i]) for line in table) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)) + "  " + line[-1]
        for line in table
    )


def run(a: argparse.Namespace) -> int:
    rows = [row(item) for item in installed(a.models_dir)]
    print(json.dumps([asdict(r) for r in rows], indent=2) if a.json else render(rows))
    return 0
