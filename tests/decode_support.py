"""Decode-node helpers only tests use: replies through the node's scheduler, in-process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.nodes.decode import lm
from tandem.nodes.decode.batching import Batcher, Join
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.openai_api import Sampling
from tandem.nodes.decode.reply import Generation


async def reply(
    batcher: Batcher,
    prompt: Sequence[int],
    params: Sampling,
    caches: lm.Caches | None = None,
    **join: Any,
) -> tuple[Generation, str, lm.Caches]:
    """One reply through `batcher` from `caches` (new ones where None): its `Generation`, the
    text its pieces made, and the caches it ended with."""
    host: ModelHost = batcher.host
    if caches is None:
        caches = await host.thread.call(host.new_cache)
    text = ""
    async with batcher.reply(Join(list(prompt), caches, params, **join)) as r:
        async for piece in r:
            text += piece
    assert r.result is not None and r.caches is not None
    return r.result, text, r.caches
