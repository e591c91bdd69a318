"""The decode node's model: mlx-lm weights and tokenizer, owned by one device thread.

Everything that touches mlx runs on `ModelHost.thread` (a `DeviceThread`); async code reaches
it with `await host.thread.call(fn, ...)`; the replies run there as ticks of the
`batching.Batcher`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.nodes.decode import lm
from tandem.nodes.decode.group.launch import GroupLaunch, Rank0, load_rank0
from tandem.nodes.decode.group.pipeline import GroupError
from tandem.nodes.model.errors import ModelError
from tandem.nodes.serve.device import DeviceThread

log = logging.getLogger(__name__)
GROUP_STOP_S = 3.0  # a decode group's other ranks take the stop order within this


class ModelHost:
    """mlx-lm model + tokenizer behind a single device thread."""

    def __init__(self, model_dir: str | Path, launch: GroupLaunch | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.thread = DeviceThread("tandem-mlx")
        self.model: Any = None
        self.tokenizer: Any = None
        self.launch = launch  # rank 0 of a decode group `mlx.launch` started
        self.group: Rank0 | None = None

    async def start(self) -> None:
        try:
            if self.launch is not None:
                self.group = await self.thread.call(load_rank0, self.model_dir, self.launch)
                self.model, self.tokenizer = self.group.model, self.group.tokenizer
            else:
                self.model, self.tokenizer = await self.thread.call(lm.load, self.model_dir)
        except GroupError as e:
            raise ModelError(f"{self.model_dir}: {e}") from e
        except Exception as e:  # mlx-lm raises many kinds; the user needs one clear line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"{self.model_dir}: mlx-lm cannot load this model: {first}") from e
        log.info("decode model loaded from %s", self.model_dir)

    def close(self) -> None:
        """Stop the mlx thread (and a group's other ranks: rank 0 orders them to stop; a
        group whose ranks no longer answer cannot be waited for, and the process exits)."""
        if self.group is not None:
            self.group.lost = self.group.lost or "the node is stopping"
            stopped = self.thread.submit(self.group.model.mirror.stop)
            try:
                stopped.result(timeout=GROUP_STOP_S)
            except Exception as e:  # the thread is stuck in a collective, or it failed
                log.error("decode group: the other ranks do not answer (%s); exiting", e)
                logging.shutdown()
                os._exit(1)
        self.thread.close()

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (a base model has none)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_tokens(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the chat-templated prompt (with `tools` where given, as mlx-lm's server
        passes them), ready for the assistant's reply."""
        ids = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=True
        )
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def new_cache(self) -> lm.Caches:
        return lm.new_caches(self.model)

    def measure_prefill(self, count: int) -> float:
        """On the mlx thread: seconds to prefill `count` tokens into a scratch cache."""
        return lm.prefill_seconds(self.model, count)
