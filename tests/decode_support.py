"""Decode-node helpers only tests use: a whole generation on the mlx thread, run to its end."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import LayerStepper
from tandem.nodes.decode.generate import Generation, texts
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.openai_api import Sampling


def generate(
    host: ModelHost,
    prompt: Sequence[int],
    cache: lm.Caches | None,
    params: Sampling,
    cancel: threading.Event,
    on_text: Callable[[str], None] | None = None,
    on_token: Callable[[int], None] | None = None,
    kv_format: KVFormat | None = None,
    first: LayerStepper | None = None,
) -> Generation:
    """On the mlx thread: `generate.texts` to its end, each piece to `on_text`."""
    pieces = texts(host.model, host.tokenizer, prompt, cache, params, cancel, on_token, kv_format,
                   first)  # fmt: skip
    while True:
        try:
            text = next(pieces)
        except StopIteration as done:
            return done.value
        if on_text is not None:
            on_text(text)
