"""Where tandem keeps its files: the user's config dir (node id, token) and cache dir (models)."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "tandem"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem"


def models_dir() -> Path:
    """Prepared and made models: the real model's forms, the random demo model."""
    return cache_dir() / "models"


ASSETS = Path(__file__).resolve().parents[1] / "assets"
