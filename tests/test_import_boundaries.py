"""Dependencies point one way (DESIGN.md "Layout"): each side imports without the frameworks
it must not need. Each module is imported in a fresh interpreter and `sys.modules` checked.

To guard a new module, add a row to BOUNDARIES.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TORCH = frozenset({"torch"})
MLX = frozenset({"mlx", "mlx_lm"})
TUI = frozenset({"textual"})
HF = frozenset({"transformers", "tokenizers"})
FRAMEWORKS = TORCH | MLX | TUI

# module → top-level packages that must stay out of sys.modules after importing it
BOUNDARIES: dict[str, frozenset[str]] = {
    "tandem.nodes.model": FRAMEWORKS | HF | {"aiohttp"},
    "tandem.nodes.model.factory": FRAMEWORKS | HF,  # tokenizers only inside make_model()
    "tandem.nodes.model.gguf_import": FRAMEWORKS | HF | {"aiohttp"},  # mlx and HF inside functions
    "tandem.nodes.contract.events": FRAMEWORKS | HF | {"aiohttp", "numpy"},
    "tandem.nodes.contract.units": FRAMEWORKS | HF | {"aiohttp", "numpy"},
    "tandem.nodes.contract.frames": FRAMEWORKS | HF | {"aiohttp"},
    "tandem.nodes.prefill": MLX | TUI,
    "tandem.nodes.prefill.engine": MLX | TUI | {"aiohttp"},  # the bare-CUDA-box bench path
    "tandem.nodes.prefill.bench": MLX | TUI | {"aiohttp"},
    "tandem.nodes.prefill.server": MLX | TUI,
    "tandem.nodes.contract.prefix": FRAMEWORKS | HF | {"aiohttp", "numpy"},
    "tandem.nodes.serve.node": FRAMEWORKS | HF,  # roles import their framework only when started
    "tandem.nodes.cluster.peers": FRAMEWORKS | HF,
    "tandem.nodes.cluster.discovery": FRAMEWORKS | HF,
    "tandem.nodes.trust.auth": FRAMEWORKS | HF,
    "tandem.app": FRAMEWORKS,
    "tandem.app.cli.main": FRAMEWORKS,
    "tandem.app.cli.bench_e2e": FRAMEWORKS,
    "tandem.app.cli.pair": FRAMEWORKS,
    "tandem.app.cli.demo": FRAMEWORKS | HF,
    "tandem.app.cli.real_model": FRAMEWORKS | HF,
}


def _loaded_after_import(module: str) -> set[str]:
    """Top-level package names in sys.modules after `import module` in a new interpreter."""
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(("module", "forbidden"), BOUNDARIES.items(), ids=list(BOUNDARIES))
def test_import_keeps_frameworks_out(module: str, forbidden: frozenset[str]) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    loaded = _loaded_after_import(module)
    assert module.split(".")[0] in loaded
    assert not loaded & forbidden, f"importing {module} loads {sorted(loaded & forbidden)}"


def test_the_check_can_fail() -> None:
    # json imports nothing heavy; a module that pulls numpy in must show up as loaded
    assert "numpy" not in _loaded_after_import("json")
    assert "numpy" in _loaded_after_import("tandem.nodes.model.factory")
