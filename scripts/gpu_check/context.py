"""What a section child knows (`Ctx`), and the small helpers every section uses."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sizes import Json, Sizes


@dataclass(frozen=True)
class Ctx:
    """What a section child knows: its sizes, the device, and the shared work directory."""

    sizes: Sizes
    cuda: bool
    work: Path

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def big(self) -> Path:
        path = self.work / "big"
        if not path.is_dir():
            raise RuntimeError("no model: the model section did not finish")
        return path


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def attempt(fn: Callable[..., Json], *args: Any) -> Json:
    """fn(*args), or the error it raised: a section goes on past one failed case."""
    try:
        return fn(*args)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}
