"""A rank's share of every layer (Megatron's tensor split, on the planner's own cuts).

Attention: the rank's KV heads [lo, hi): their q/k/v rows, and o_proj's *columns* for their
query heads (`Piece.cols`), so the rank's o_proj gives its heads' share of the whole output
[T, H]; the MLP: its intermediate rows of gate/up and down_proj's columns for them; a mixture
of experts: the router on every rank, each rank its block of the experts (and its rows of a
shared expert). One sum over the ranks after each branch (`Pass.reduce`), before the branch's
bias or norm and the residual; norms and the residual stay whole on every rank. A layer's
K/V (or state) is the rank's heads', zeros elsewhere: summed into rank 0 it is the layer's.

`ShardedFamily` wraps a family: its loads are the rank's parts, packed into slots (an op's
share is never cut further: a budget that cannot hold one is refused by the plan).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.spec import LayerKind
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.kernels.blocks import LayerState
from tandem.nodes.prefill.planning.loads import Part, pack
from tandem.nodes.prefill.prefix_upload import KV, Prefix, State

if TYPE_CHECKING:  # the families import this module
    from tandem.nodes.prefill.families.base import Groups, Pass, PrefillFamily, Weights


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world` ranks."""

    rank: int = 0
    world: int = 1

    def range(self, total: int, unit: int = 1, what: str = "") -> tuple[int, int]:
        """This rank's share [lo, hi) of `total` `what` (heads, rows, experts), even shares
        starting at multiples of `unit`; the last rank takes the remainder."""
        if total < self.world * unit:
            of = f" {what}" if what else ""
            raise PrefillError(f"{total}{of} cannot be split over {self.world} ranks in units "
                               f"of {unit}: serve this model on fewer devices")  # fmt: skip
        at = [min(total, round(r * total / self.world / unit) * unit) for r in range(self.world)]
        at.append(total)
        return at[self.rank], at[self.rank + 1]


WHOLE = Shard()


def apart(last: Part, part: Part) -> bool:
    """Whether `part` may join a load ending in `last`: experts only with experts (they are
    read once the router chose; the rest is not)."""
    return (part.op == "experts") == (last.op == "experts")


class ShardedFamily:
    """A family as rank `shard.rank` computes it (see the module doc)."""

    def __init__(self, inner: PrefillFamily, shard: Shard) -> None:
        self.inner, self.shard = inner, shard
        self.name, self.State = inner.name, inner.State

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        return self.inner.shard_layer(index, layer, self.shard)

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        return pack(self.whole_layer(index, layer), max_bytes, direct, joins=apart)

    def begin(self, p: Pass, h: torch.Tensor) -> Pass:
        return self.inner.begin(p, h)

    def routing(self, part: Part, state: LayerState) -> frozenset[int] | None:
        return self.inner.routing(part, state)

    def new_state(
        self, p: Pass, kind: LayerKind, layer: int, count: int, prefix: Prefix | None
    ) -> LayerState:
        """The family's state, its new positions' K/V zeroed: the other ranks' heads stay
        zero, so the sum over the ranks is the layer's K/V."""
        state = self.inner.new_state(p, kind, layer, count, prefix)
        if state.k.numel():
            state.k[:, :, p.start :].zero_()
            state.v[:, :, p.start :].zero_()
        return state

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        return self.inner.compute(p, part, weights, h, state)

    def compute_experts(
        self, p: Pass, parts: Sequence[Part], views: Mapping[str, torch.Tensor],
        h: torch.Tensor, state: LayerState,
    ) -> bool:  # fmt: skip
        return self.inner.compute_experts(p, parts, views, h, state)

    def handover(self, p: Pass, kind: LayerKind, layer: int, state: LayerState) -> KV | State:
        return self.inner.handover(p, kind, layer, state)


def sharded(family: PrefillFamily, shard: Shard | None) -> PrefillFamily:
    """`family` as rank `shard.rank` computes it; itself for one rank."""
    if shard is None or shard.world == 1:
        return family
    return ShardedFamily(family, shard)  # type: ignore[return-value]


def last_of(parts: list[Part]) -> list[Part]:
    """A rank's parts with its own last expert marked last (its experts' sum is reduced
    there, `experts.compute_experts`)."""
    at = max((i for i, p in enumerate(parts) if p.op == "experts"), default=None)
    if at is not None:
        parts[at] = dataclasses.replace(parts[at], last=True)
    return parts
