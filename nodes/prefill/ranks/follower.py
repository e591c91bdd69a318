"""A rank other than 0: no port; rank 0's passes, computed in step (`collective.py`), until
rank 0 stops the node (or is gone). Its layer and link events reach the node's bus through rank
0 (`events.py`, set up with its engine)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.nodes.prefill.engine import PrefillEngine

log = logging.getLogger(__name__)


def follow(engine: PrefillEngine) -> int:
    """Run rank 0's passes on this rank's share until it stops; the passes run."""
    c = engine.collective
    assert c is not None and c.rank != 0
    passes = 0
    while (asks := c.receive()) is not None:
        for _ in engine.prefill_pass(asks):
            pass  # rank 0 hands the layers over
        passes += 1
    log.info("rank %d: rank 0 stopped after %d passes", c.rank, passes)
    return passes
