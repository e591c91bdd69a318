"""Shared fixtures: tiny models are made once per session and cached by their arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from nodes.model.factory import MakeModelArgs, make_model

MakeTiny = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> MakeTiny:
    """`tiny_model(arch="llama", layers=4, ...)` → a model directory, made once per arguments."""
    made: dict[MakeModelArgs, Path] = {}

    def make(**kwargs: object) -> Path:
        args = MakeModelArgs(**kwargs)  # type: ignore[arg-type]
        if args not in made:
            name = "-".join(f"{k}{v}" for k, v in dataclasses.asdict(args).items() if v is not None)
            made[args] = make_model(tmp_path_factory.mktemp(name[:60]), args)
        return made[args]

    return make


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`cuda` and `mps` tests skip by themselves where that hardware is missing."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs an NVIDIA GPU")
    if item.get_closest_marker("mps") is not None:
        import torch

        if not torch.backends.mps.is_available():
            pytest.skip("needs Apple Metal")
