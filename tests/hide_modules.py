"""Run a child Python as if some top-level packages were not installed.

`hidden_env(tmp, ["torch"])` returns env vars whose `sitecustomize` wraps every meta-path
finder so `import torch` fails and `importlib.util.find_spec("torch")` is None — what a Mac
decode node without torch, or a CUDA box without mlx, looks like to the code.
"""

from __future__ import annotations

import os
from pathlib import Path

_SITE = """
import importlib.abc, sys
_HIDDEN = {hidden!r}

class _Hide(importlib.abc.MetaPathFinder):
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None
    def invalidate_caches(self):
        getattr(self.inner, "invalidate_caches", lambda: None)()
    def __getattr__(self, attr):  # find_distributions and friends
        return getattr(self.inner, attr)

sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
"""


def hidden_env(tmp: Path, hidden: list[str]) -> dict[str, str]:
    site = tmp / f"hide-{'-'.join(hidden)}"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE.format(hidden=set(hidden)))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}
