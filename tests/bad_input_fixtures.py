"""The module-scoped fixtures both bad-input test files use (issue 18): the model and mlx-lm
as its oracle. A test module takes them as `llama = bad_input_fixtures.llama` (as the
discovery tests take `fake_peer_support.model`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.bad_input_support import Oracle, tiny_llama


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> Path:
    return tiny_llama(tiny_model)


@pytest.fixture(scope="module")
def oracle(llama: Path) -> Oracle:
    return Oracle(llama)
