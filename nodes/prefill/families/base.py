"""What a prefill family does with a layer, and what every family shares.

A family is one architecture's prefill side (mlx-lm keeps one file per architecture; so do
we; its decode side is `nodes/decode/families/`). It does three jobs, per layer:

- `layer_groups`: what the layer's loads are: its weights as `Part`s (`loads.py`), grouped
  into loads that each fit a slot of `max_bytes` (the planner, `plan.py`, asks for the
  coarsest split that fits, and places the loads in the ring or the resident set);
- `begin`: the pass as the family computes it, once the prompt's rows are embedded (Gemma 3
  scales them, and adds its sliding layers' RoPE tables);
- `new_state` and `compute`: the layer's working state, and one part computed over it (the
  engine hands the parts over in load order, each part's weights as views into its slot);
- `handover`: what the layer hands the decode node once its attention is done, by the
  layer's kind (`LayerKind` from the model spec): a "full" layer its K/V of the new
  positions; a "sliding" layer the window of K/V its decode cache keeps; a "linear" layer
  its fixed-size state.

Mixtures of experts: a layer's "experts" parts (one expert each) come in loads after the
layer's router. `routing` tells the engine which experts the tokens chose once the router
ran; the streamer then reads only those experts' pieces of the loads that follow.

`PrefillFamily` hands over "full" layers and refuses the other kinds (a `PrefillError`),
which the families that have them override.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.spec import LayerKind, ModelSpec
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.kernels.blocks import LayerState
from tandem.nodes.prefill.planning.loads import Part
from tandem.nodes.prefill.prefix_upload import KV, Prefix, State
from tandem.nodes.prefill.ranks.shard import WHOLE, Shard

Weights = dict[str, torch.Tensor]  # a part's tensors by short name: views into its slot
Groups = list[list[Part]] | None  # a layer's loads (each a list of parts), or None: no fit


@dataclass(frozen=True)
class Pass:
    """What every part of one request's prefill computes with."""

    index: ModelIndex
    start: int  # the first new position (positions 0..start-1 come from the prefix)
    chunk: int  # tokens per attention query block and MLP block (bounds activations)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, D] of the new positions
    scratch: torch.Tensor  # uint8 device bytes a quantized part dequantizes into
    dtype: torch.dtype  # the compute dtype
    # cos, sin [T, D] by layer kind where a kind's differ from `rope` (Gemma 3's "sliding")
    ropes: Mapping[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # two ranks or more (`ranks/`): sums a rank's share of a branch's output over the ranks,
    # in place, before the branch joins the residual; None for one device
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    shard: Shard = WHOLE  # this rank's share of every layer

    @property
    def spec(self) -> ModelSpec:
        return self.index.spec

    def rope_of(self, kind: LayerKind) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables of a layer of `kind`."""
        return self.ropes.get(kind.kind, self.rope)


class PrefillFamily:
    """A family's prefill side: the interface, and the parts every family shares."""

    name = "base"
    State: type[LayerState] = LayerState  # what `new_state` makes (a family may extend it)

    def layer_groups(self, index: ModelIndex, layer: int, max_bytes: int, direct: bool) -> Groups:
        """The coarsest split of `layer` into loads of at most `max_bytes` each (a load's
        parts in compute order), or None when none fits."""
        raise NotImplementedError

    def whole_layer(self, index: ModelIndex, layer: int) -> list[Part]:
        """The layer's parts uncut, as one load (a resident layer, or a budget that holds it)."""
        raise NotImplementedError

    def shard_layer(self, index: ModelIndex, layer: int, shard: Shard) -> list[Part]:
        """Rank `shard.rank`'s share of the layer uncut, in compute order (`ranks/shard.py`);
        a family that does not split refuses two ranks."""
        raise PrefillError(f"the {self.name} prefill family does not split over ranks yet: "
                           "serve it on one device")  # fmt: skip

    def begin(self, p: Pass, h: torch.Tensor) -> Pass:
        """The pass as this family computes it, given the prompt's embedded rows h [T, H]
        (which it may scale in place): the dense families' as it is."""
        return p

    def routing(self, part: Part, state: LayerState) -> frozenset[int] | None:
        """After `part` computed: the experts the layer's tokens chose, once its router ran (a
        mixture of experts: the streamer then loads only those); None otherwise."""
        return None

    def new_state(
        self,
        p: Pass,
        kind: LayerKind,
        layer: int,
        count: int,
        prefix: Prefix | None,
    ) -> LayerState:
        """The layer's state for `count` new tokens after `p.start` positions: K/V buffers
        [1, n_kv, start + count, D] holding the prefix's `prefix` (K, V) [1, n_kv, start, D]
        (a family with linear layers makes theirs from a prefix `State`)."""
        spec, device = p.spec, p.scratch.device
        shape = (1, spec.num_kv_heads, p.start + count, spec.head_dim)
        k = torch.empty(shape, dtype=p.dtype, device=device)
        v = torch.empty(shape, dtype=p.dtype, device=device)
        if p.start:
            if not isinstance(prefix, tuple):
                raise PrefillError(f"layer {layer}: a {kind.kind} layer's prefix is not K/V")
            pk, pv = prefix
            if tuple(pk.shape) != (1, spec.num_kv_heads, p.start, spec.head_dim):
                raise PrefillError(f"prefix K of layer {layer} has shape {tuple(pk.shape)}")
            k[:, :, : p.start] = pk.to(device, p.dtype)
            v[:, :, : p.start] = pv.to(device, p.dtype)
        return self.State(k, v)

    def compute(
        self, p: Pass, part: Part, weights: Weights, h: torch.Tensor, state: LayerState
    ) -> bool:
        """Run `part` over the hidden states h [T, H] (in place) with its `weights` (views
        into the slot, quantized matrices still packed). True when it finished what the
        layer hands over (its attention): the engine takes the handover then, while the
        rest of the layer computes."""
        raise NotImplementedError

    def compute_experts(
        self,
        p: Pass,
        parts: Sequence[Part],
        views: Mapping[str, torch.Tensor],
        h: torch.Tensor,
        state: LayerState,
    ) -> bool:
        """A load of experts at once (a mixture of experts: `experts.compute_experts`), its
        `views` keyed `op:lo:name`; False where the family computes its parts one by one."""
        return False

    def handover(self, p: Pass, kind: LayerKind, layer: int, state: LayerState) -> KV | State:
        """What the layer hands over once `compute` said so: a "full" layer's K and V of the
        new positions [1, n_kv, count, D] (views into its state); a "linear" layer's state
        (a family that has them)."""
        if kind.kind != "full":
            raise PrefillError(
                f"layer {layer}: a {kind.kind} layer is not handed over by the {self.name} "
                "prefill family"
            )
        return state.k[:, :, p.start :], state.v[:, :, p.start :]
