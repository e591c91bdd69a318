"""Dependencies point one way (docs/internals.md, "Layout"): each folder imports only what its
row names.

One row per folder. Every module found on disk under a folder is imported (new modules are
covered without a new row), and the top-level packages in `sys.modules` are checked after
each import. A folder's modules share one fresh interpreter: they are imported narrowest
allowance first and the check reads everything loaded so far, so a name that appears is
charged to the first module whose import brought it in, and nothing a wider module loads can
be charged to a narrower one. A folder, or a module named below, that is missing fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.hide_modules import hidden_env

ROOT = Path(__file__).resolve().parents[1]

# import names of what pyproject.toml installs: a row allows some of these (they bring their own
# dependencies along, which are not checked); a stdlib-only row allows nothing outside stdlib
DEPENDENCIES = frozenset({
    "aiohttp", "zeroconf", "safetensors", "numpy", "isal", "cryptography", "torch", "mlx",
    "mlx_lm", "transformers", "tokenizers", "gguf", "textual", "accelerate", "prometheus_client",
    "huggingface_hub",
})  # fmt: skip
STDLIB: frozenset[str] = frozenset()
MODEL = frozenset({"safetensors", "numpy"})
FRAMES = frozenset({"numpy", "isal"})  # the KV frame codec: numpy views, isal's crc32
HF = frozenset({"transformers", "tokenizers", "huggingface_hub"})  # transformers loads the hub
TRUST = frozenset({"aiohttp", "cryptography"})
SERVE = TRUST | FRAMES | {"zeroconf", "prometheus_client"}  # /metrics: serve/metrics.py
PREFILL = MODEL | FRAMES | {"torch"}  # the bare-CUDA-box bench path: no aiohttp
DECODE = SERVE | MODEL | HF | {"mlx", "mlx_lm"}
CLI = SERVE | MODEL  # roles import their framework only when started
TUI = CLI | {"textual"}


Loaded = set[str] | str  # top-level names in sys.modules, or the traceback of a failed import


@dataclass(frozen=True)
class Row:
    folder: str  # a package; its modules (and sub-folders' without a row of their own)
    may_import: frozenset[str]
    only: dict[str, frozenset[str]] | None = None  # module → its own allowance, not the row's
    # not installed on the machine this folder runs on: a Mac decode node has no torch (else
    # transformers, under mlx_lm, loads torch here), and an import of it fails
    absent: tuple[str, ...] = ()


ROWS = (
    Row("tandem.nodes", STDLIB),
    Row(
        "tandem.nodes.contract",
        STDLIB,
        {"tandem.nodes.contract.frames": FRAMES, "tandem.nodes.contract.frame_reader": FRAMES},
    ),
    Row("tandem.nodes.trust", TRUST),
    Row("tandem.nodes.cluster", SERVE),
    Row("tandem.nodes.serve", SERVE),
    Row("tandem.nodes.model", MODEL),  # mlx and HF only inside functions (gguf_import, factory)
    Row("tandem.nodes.prefill", PREFILL, {"tandem.nodes.prefill.serving.server": PREFILL | SERVE}),
    Row("tandem.nodes.decode", DECODE, absent=("torch",)),
    Row("tandem.app", STDLIB),
    Row("tandem.app.cli", CLI),
    Row("tandem.app.tui", TUI),
)
SKIP = frozenset({"__main__"})  # importing it runs the command


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is missing"
    return Path(next(iter(spec.submodule_search_locations)))


def _modules(row: Row) -> list[str]:
    """Every module on disk under the row's folder, less sub-folders that have rows."""
    top = _package_dir(row.folder)
    owned = {_package_dir(r.folder) for r in ROWS if r.folder.startswith(row.folder + ".")}
    found = []
    for path in sorted(top.rglob("*.py")):
        if "__pycache__" in path.parts or any(d in path.parents for d in owned):
            continue
        parts = path.relative_to(top).with_suffix("").parts
        if parts[-1] in SKIP:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append(".".join((row.folder, *parts)))
    return found


def _import_in_order(
    modules: list[str], env: dict[str, str] | None = None
) -> dict[str, set[str] | str]:
    """Import `modules` in order in one new interpreter: after each, the top-level names in
    sys.modules so far (or the error its import raised)."""
    code = (
        "import importlib, json, sys, traceback\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        out = sorted({m.split('.')[0] for m in sys.modules})\n"
        "    except BaseException:\n"
        "        out = traceback.format_exc()\n"
        "    print(json.dumps([name, out]), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(modules)], cwd=ROOT, capture_output=True,
        text=True, timeout=120, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('["')]
    return {name: out if isinstance(out, str) else set(out) for name, out in rows}


def loaded_after_import(module: str) -> set[str]:
    """Top-level names in sys.modules after `import module` alone, in a new interpreter."""
    got = _import_in_order([module])[module]
    assert not isinstance(got, str), got
    return got


def _unexpected(loaded: set[str], allowed: frozenset[str]) -> set[str]:
    if allowed:
        return (loaded & DEPENDENCIES) - allowed
    outside = loaded - sys.stdlib_module_names - {"tandem", "__main__", "_distutils_hack"}
    return {n for n in outside if not n.startswith("__editable__")}  # the editable finder


def _in_processes(row: Row, modules: list[str]) -> list[list[str]]:
    """Split `modules` into import orders, each narrowest allowance first, in which every
    module's allowance holds the allowances before it (a single order unless two differ)."""
    allow = {m: (row.only or {}).get(m, row.may_import) for m in modules}
    orders: list[list[str]] = []
    for m in sorted(modules, key=lambda m: len(allow[m])):
        fits = next((o for o in orders if allow[o[-1]] <= allow[m]), None)
        if fits is None:
            orders.append(fits := [])
        fits.append(m)
    return orders


@pytest.mark.parametrize("row", ROWS, ids=[r.folder for r in ROWS])
def test_folder_imports_only_what_its_row_names(row: Row, tmp_path: Path) -> None:
    modules = _modules(row)
    assert modules, f"no modules under {row.folder}"
    missing = set(row.only or {}) - set(modules)
    assert not missing, f"{sorted(missing)} named in {row.folder}'s row do not exist"
    problems = []
    for order in _in_processes(row, modules):
        loaded = _import_in_order(
            order, hidden_env(tmp_path, [*row.absent]) if row.absent else None
        )
        for m in order:
            got = loaded.get(m, "the interpreter stopped before it")
            if isinstance(got, str):
                problems.append(f"{m} does not import:\n{got}")
                continue
            bad = _unexpected(got, (row.only or {}).get(m, row.may_import))
            if bad:
                problems.append(f"importing {m} loads {sorted(bad)}")
            assert "tandem" in got, m
    assert not problems, "\n".join(problems)


def test_every_folder_has_a_row() -> None:
    folders = {r.folder for r in ROWS}
    for top in ("tandem.nodes", "tandem.app"):
        for sub in _package_dir(top).iterdir():
            if (sub / "__init__.py").exists():
                assert f"{top}.{sub.name}" in folders, f"{top}.{sub.name} has no row"


def test_the_check_can_fail() -> None:
    # json imports nothing heavy; a module that pulls numpy in must show up as loaded
    loaded = _import_in_order(["json", "tandem.nodes.model.factory"])
    assert not _unexpected(loaded["json"], STDLIB)
    assert _unexpected(loaded["tandem.nodes.model.factory"], STDLIB) >= {"numpy"}
    assert "numpy" in _unexpected(loaded["tandem.nodes.model.factory"], frozenset({"torch"}))
    assert (
        "No module named"
        in _import_in_order(["tandem.nodes.no_such_module"])["tandem.nodes.no_such_module"]
    )
