"""What a completion yields and says of itself, beside the pipeline (`service.py`): its last
item, the prefill it had, and the one error a generation that broke raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.nodes.decode.families.base import LayerStepper
from tandem.nodes.decode.reply import Generation


class GenerationFailed(Exception):
    """The generation broke after the request was accepted; the message says how (500, or
    503 where a decode group lost a rank)."""

    def __init__(self, message: str, status: int = 500, code: str = "generation_failed") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class PrefillInfo:
    where: str = "local"
    node: str | None = None
    tokens: int = 0
    seconds: float = 0.0
    kv_bytes: int = 0
    first: LayerStepper | None = None  # the last prompt token's pass, already run
    cached: int = 0  # positions the prompt cache held
    cache_fallback: bool = False  # a window could not be cut back: an earlier exact point


@dataclass(frozen=True)
class Finished:
    """The last item of a completion: what was generated and the reply's `tandem` object."""

    generation: Generation
    tandem: dict[str, Any]
