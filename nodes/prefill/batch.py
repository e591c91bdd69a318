"""One weight pass, many prompts (issue 46; FlexGen's insight): while a layer's loads sit in
their slots, each prompt in the pass runs through them with its own hidden states, K/V or
state, prefix and handover, and hands its layer over as soon as it is done.

`Ask` is what a request brings to a pass; `Member` is its share of the pass's work, made and
used by the engine (`PrefillEngine.prefill_pass`) on its device thread. A member whose reader
is gone (`Ask.dropped`) is skipped from its next load on; the pass goes on for the rest.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.prefill.families import Pass
from tandem.nodes.prefill.handover import Handover
from tandem.nodes.prefill.kernels.blocks import LayerState
from tandem.nodes.prefill.prefix_upload import Prefix, PrefixUpload
from tandem.nodes.prefill.stats import PrefillStats


@dataclass
class Ask:
    """One request's prompt in a pass: positions `start..start+len(tokens)-1`, after the
    prefix K/V (or state) of positions 0..start-1."""

    tokens: Sequence[int]
    start: int = 0
    prefix: Sequence[Prefix] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    kv_format: KVFormat | None = None
    dropped: threading.Event = field(default_factory=threading.Event)  # its reader is gone

    @property
    def count(self) -> int:
        return len(self.tokens)


@dataclass
class Member:
    """An ask's working share of the pass: its pass record, hidden states h [T, H], the
    current layer's state, its handover, its prefix upload and its stats."""

    ask: Ask
    index: int  # its place in the pass
    handover: Handover
    stats: PrefillStats
    t_start: float
    uploads: PrefixUpload | None = None
    p: Pass | None = None
    h: torch.Tensor | None = None
    state: LayerState | None = None

    @property
    def live(self) -> bool:
        return not self.ask.dropped.is_set()

    def prefix_of(self, layer: int) -> Prefix | None:
        return self.uploads.layer(layer) if self.uploads is not None else None
