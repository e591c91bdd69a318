"""The dashboard and the demo stay clear of torch and mlx (DESIGN.md "Layout"); the CLI's
entry points and the dashboard's models stay clear of Textual too."""

from __future__ import annotations

import pytest

from tests.test_import_boundaries import loaded_after_import as _loaded_after_import

TORCH = frozenset({"torch"})
MLX = frozenset({"mlx", "mlx_lm"})
TUI = frozenset({"textual"})

BOUNDARIES: dict[str, frozenset[str]] = {
    "tandem.app.tui.app": TORCH | MLX,
    "tandem.app.tui.command": TORCH | MLX | TUI,  # the CLI imports it at start-up
    "tandem.app.cli.demo": TORCH | MLX | TUI,
    "tandem.app.tui.client": TORCH | MLX | TUI,
    "tandem.app.tui.cluster": TORCH | MLX | TUI,
    "tandem.app.tui.pipeline": TORCH | MLX | TUI,
    "tandem.app.tui.rates": TORCH | MLX | TUI,
}


@pytest.mark.parametrize(("module", "forbidden"), BOUNDARIES.items(), ids=list(BOUNDARIES))
def test_dashboard_imports_keep_frameworks_out(module: str, forbidden: frozenset[str]) -> None:
    loaded = _loaded_after_import(module)
    assert "tandem" in loaded
    assert not loaded & forbidden, f"importing {module} loads {sorted(loaded & forbidden)}"


def test_the_dashboard_does_load_textual() -> None:
    assert "textual" in _loaded_after_import("tandem.app.tui.app")
