"""Whether a pass's routed loads (a mixture of experts' layers) wait for their routers: read
only the experts the prompt's tokens chose, or every expert at once with no wait.

The routers' counts decide. Before any router has run, the prompt's length does, through the
share of experts its tokens are expected to choose (`MoeSpec.expected_share`, the plan's own
curve); a router that chose nearly all of its experts ends the waiting, and one that chose
few of them (a skewed router) starts it again, where the link binds (the loader has waited
less for compute to free slots than it has read): only there do unread experts save time.
Waiting also stops for the rest of the pass once the link has stood longer, waiting, than the
experts left unread would have taken.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

ALL_EXPERTS = 0.9  # a router that chose this share of its experts: read later ones whole
FEW_EXPERTS = 0.5  # ... and one that chose less than this: wait for routers again
Route = bool | Literal["always"]  # whether a routed load waits for its router (`stream`)


@dataclass
class Routing:
    """One pass's routing. `mode`: False reads every expert whatever the routers chose (a
    pass that computes nothing); True waits for routers while the counts and the cost say
    so; "always" waits for every router (tests of exact routing)."""

    mode: Route = True
    nearly_all: bool = False  # the last router chose nearly all its experts (before any:
    # the prompt's tokens are expected to)
    routes: dict[int, frozenset[int]] = field(default_factory=dict)  # layer → chosen experts
    waiting_pays: bool = True  # until `check_cost` finds it does not
    link_binds: bool = True  # the loader reads more than it waits for compute to free slots
    saved_bytes: int = 0  # experts' bytes left unread thanks to the routers

    @property
    def waits(self) -> bool:
        """Whether a routed load whose router has not run yet waits for it."""
        if not self.mode:
            return False
        pays = self.waiting_pays and self.link_binds and not self.nearly_all
        return self.mode == "always" or pays

    def chose(self, layer: int, used: frozenset[int], experts: int) -> None:
        """Layer `layer`'s router chose `used` of its `experts` experts."""
        self.routes[layer] = used
        if len(used) >= ALL_EXPERTS * experts:
            self.nearly_all = True
        elif len(used) < FEW_EXPERTS * experts:  # a skewed router: routing saves again
            self.nearly_all = False

    def check_cost(self, waited_s: float, nbytes: int, busy_s: float) -> None:
        """Stop waiting once the link has idled `waited_s`, waiting for routers, longer than
        the experts left unread would have taken at the rate loads have filled (`nbytes` in
        `busy_s`): routing saved bytes but cost more time."""
        if self.mode is not True or not self.waits or busy_s <= 0 or not nbytes:
            return
        if waited_s > self.saved_bytes / (nbytes / busy_s):
            log.debug("routing stopped paying (%.3f s waited): every expert from here", waited_s)
            self.waiting_pays = False
