"""Run this checkout's code uninstalled (a bare CUDA box with only torch, safetensors, numpy).

An install maps `app/` and `nodes/` to `tandem.app` and `tandem.nodes`; here `tandem` is made
a namespace whose one folder is the checkout's root, which gives the same names.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_checkout() -> None:
    """Import `tandem.*` from this checkout unless an installed `tandem` is there."""
    try:
        import tandem.nodes  # noqa: F401
    except ModuleNotFoundError:
        package = types.ModuleType("tandem")
        package.__path__ = [str(ROOT)]
        sys.modules["tandem"] = package
