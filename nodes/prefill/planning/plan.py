"""How a model's weights flow through a fixed budget: which bytes form each load, in what order,
into which slots, and which layers stay resident.

A *load* is what one slot holds at a time: a whole layer, or one part of it (attention or
MLP), or a slice of a part when even parts do not fit (`loads.py`). How a layer is cut is its
family's (`families/`: the dense family cuts by the rows of its matrices, so every piece is
one run of its file, read by O_DIRECT); the planner asks each layer for the coarsest split
that fits a slot, sizes the ring and picks the resident set.

The access is cyclic (layer 0..L-1, then again), so the policy is a ring of slots fed in order
plus a fixed resident set — never LRU, which evicts exactly the layer needed next. Three tiers
hold the weights: the device (the resident set; the ring is only a window), system RAM (the
RAM tier: `host_loads`, a fixed set of streamed loads, `ram.py` sizes it) and the disk (the
rest of the streamed set, read every pass).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.prefill.families import PrefillFamily, family_for
from tandem.nodes.prefill.planning.loads import (
    Load,
    Part,
    ResidentForm,
    layout,
    resident_floats,
    resident_form,
    slot_size,
)
from tandem.nodes.prefill.planning.scratch import TIGHT_TEMP_ROWS, scratch_bytes

MAX_RING_SLOTS = 3  # whole-layer slots
RING_LOADS = 4  # a cut layer: loads in flight, each at most a RING_LOADS-th of the ring
MIN_SLICE = 4096  # bytes: the smallest load a quantized plan tries before giving up


@dataclass(frozen=True)
class Plan:
    loads: tuple[Load, ...]
    resident_layers: tuple[int, ...]
    n_slots: int
    slot_bytes: int
    budget_bytes: int
    scratch_bytes: int = 0  # where a quantized model's parts are dequantized
    reserve_bytes: int = 0  # kept free for activations
    host_loads: frozenset[int] = frozenset()  # seqs of the streamed loads kept in RAM
    # a quantized model's resident layers: "packed" (dequantized into the scratch each pass),
    # "dequantized" (each matrix once, into device memory of its own: these bytes), or
    # "partly" (the loads `resident_floats` so, the rest packed)
    resident_form: ResidentForm = "packed"
    resident_float_bytes: int = 0
    resident_floats: frozenset[int] = frozenset()  # seqs of the resident loads kept in float

    def describe(self, reserve: int, max_prompt: int | None, pinned: int) -> str:
        """The plan in one line, for the node's log."""
        return (
            f"plan: {self.granularity} granularity, {self.n_slots} ring slots of "
            f"{self.slot_bytes} B, resident layers {list(self.resident_layers)}, pool "
            f"{self.pool_bytes} B + scratch {self.scratch_bytes} B + activations {reserve} B "
            f"(prompts up to {max_prompt or 'any'} tokens) of {self.budget_bytes}; {pinned} B "
            f"pinned; per pass {self.ram_bytes} B from the RAM tier, {self.disk_bytes} B from disk"
        )

    def with_host(self, host_bytes: int) -> Plan:
        """This plan with a RAM tier of `host_bytes`: the streamed loads `host_set` picks — a
        fixed set (the access is cyclic: never LRU)."""
        return replace(self, host_loads=host_set(self.loads, host_bytes))

    @property
    def streamed_bytes(self) -> int:
        """Weight bytes streamed through the ring each warm pass."""
        return sum(ld.weight_bytes for ld in self.loads if not ld.resident)

    @property
    def ram_bytes(self) -> int:
        """Of `streamed_bytes`, those served from the RAM tier once it holds them."""
        return sum(ld.weight_bytes for ld in self.loads if ld.seq in self.host_loads)

    @property
    def disk_bytes(self) -> int:
        """Of `streamed_bytes`, those read from disk every warm pass."""
        return self.streamed_bytes - self.ram_bytes

    @property
    def host_bytes(self) -> int:
        """RAM the tier takes (its loads as laid out)."""
        return sum(ld.nbytes for ld in self.loads if ld.seq in self.host_loads)

    @property
    def device_bytes(self) -> int:
        """Everything the weights take on the device: pool plus scratch, within the budget
        less the activation reserve."""
        return self.pool_bytes + self.scratch_bytes + self.resident_float_bytes

    @property
    def resident_bytes(self) -> int:
        return sum(ld.nbytes for ld in self.loads if ld.resident)

    @property
    def pool_bytes(self) -> int:
        """Device memory reserved for weights: the ring plus the resident set."""
        return self.n_slots * self.slot_bytes + self.resident_bytes

    @property
    def cuts_ops(self) -> bool:
        """Whether an op is cut into row ranges (its output kept across them)."""
        return any(part.op not in ("attn", "mlp") for ld in self.loads for part in ld.parts)

    @property
    def granularity(self) -> str:
        streamed = [ld for ld in self.loads if not ld.resident]
        if not streamed:
            return "resident"
        n = max(sum(1 for ld in streamed if ld.layer == i) for i in {ld.layer for ld in streamed})
        return {1: "layer", 2: "part"}.get(n, "slice")


def _loads(
    groups_per_layer: list[list[list[Part]]], resident: set[int], direct: bool
) -> tuple[Load, ...]:
    loads: list[Load] = []
    for i, groups in enumerate(groups_per_layer):
        if i in resident:  # a resident layer is one load into its own region
            groups = [[part for g in groups for part in g]]
        for j, parts in enumerate(groups):
            offsets, size = layout([p for part in parts for p in part.pieces], direct)
            loads.append(
                Load(
                    seq=len(loads),
                    layer=i,
                    parts=tuple(parts),
                    offsets=tuple(offsets),
                    nbytes=size,
                    first_of_layer=j == 0,
                    last_of_layer=j == len(groups) - 1,
                    resident=i in resident,
                    direct=direct,
                )
            )
    return tuple(loads)


def host_set(loads: tuple[Load, ...] | list[Load], budget: int) -> frozenset[int]:
    """Seqs of the streamed loads a RAM tier of `budget` bytes keeps: as many as fit, spread
    evenly through the cycle from the first. Between two loads from disk the link then copies
    one from RAM while the disk reads the next (CUDA: a tier load takes no staging buffer);
    held all in a row, the disk would idle through them and the link through the rest."""
    streamed = [ld for ld in loads if not ld.resident]
    n, count, used = len(streamed), 0, 0
    for size in sorted(ld.nbytes for ld in streamed):
        if used + size > budget:
            break
        used, count = used + size, count + 1
    while count:
        spread = [streamed[j * n // count] for j in range(count)]
        if sum(ld.nbytes for ld in spread) <= budget:
            return frozenset(ld.seq for ld in spread) | _fill(streamed, spread, budget)
        count -= 1  # uneven loads: fewer, until an even spread fits
    return _fill(streamed, [], budget)


def _fill(streamed: list[Load], chosen: list[Load], budget: int) -> frozenset[int]:
    """More of the streamed loads for the room an even spread of uneven loads left (small
    attention loads between large expert loads: the spread that fits takes a fraction of the
    tier), spread by bytes: each load earns its share of the room, and joins once its earnings
    cover it (Bresenham's spread, by bytes instead of by count)."""
    taken = {ld.seq for ld in chosen}
    room = budget - sum(ld.nbytes for ld in chosen)
    rest = [ld for ld in streamed if ld.seq not in taken]
    total = sum(ld.nbytes for ld in rest)
    if room <= 0 or not total:
        return frozenset()
    share, credit, more = min(1.0, room / total), 0.0, set()
    for ld in rest:
        credit += ld.nbytes * share
        if credit >= ld.nbytes and ld.nbytes <= room:
            more.add(ld.seq)
            credit, room = credit - ld.nbytes, room - ld.nbytes
    return frozenset(more)


def _resident_set(layer_bytes: list[int], room: int) -> set[int]:
    """As many whole layers as fit in `room` bytes (never all), spread evenly from layer 0.

    Layer 0 lets compute start while the ring fills; each later one hands compute a layer that
    needs no load, so the loader gets ahead of a two-slot ring. All of them at the front
    would instead leave the loader idle, its ring full, while compute works through them.
    """
    n, count, used = len(layer_bytes), 0, 0
    for size in sorted(layer_bytes):
        if used + size > room or count >= n - 1:
            break
        used, count = used + size, count + 1
    while count:
        spread = {j * n // count for j in range(count)}
        if sum(layer_bytes[i] for i in spread) <= room:
            return spread
        count -= 1  # uneven layer sizes: fewer, until an even spread fits
    return set()


def make_plan(
    index: ModelIndex, budget: int, direct: bool = False, reserve: int = 0,
    family: PrefillFamily | None = None,
) -> Plan:  # fmt: skip
    """Choose slot size, slot count and resident set for `budget` bytes of device memory, of
    which `reserve` bytes stay free for activations.

    Half the weight budget goes to the ring when the model does not fit (so a resident set
    can stay loaded across requests); the ring takes all of it when that is the only way to
    double buffer; a single slot (no overlap) is the last resort. Whole layers stream when
    two fit the ring; a layer that must be cut is cut into loads of at most a
    `RING_LOADS`-th of the ring, so loads come out of roughly equal size and several are in
    flight — with two slots, attention in one and the MLP in the other, the MLP's copy would
    wait for the previous MLP's compute. `direct` lays loads out for O_DIRECT reads
    (`layout`).

    A quantized model's loads hold its packed bytes as stored; each part is dequantized into
    a scratch of the compute dtype, counted in the budget beside the ring and the resident
    set: room for all the part's matrices where the budget allows it, else for its largest
    matrix, each dequantized when compute reaches it. Its resident layers keep the streamed
    layers' slices (one load, several parts), so the scratch stays the size of a slice's
    matrices, not a whole MLP's.
    """
    weights = _weight_budget(index, budget, reserve)
    n, itemsize = index.spec.num_layers, ITEMSIZE[index.dtype]
    family = family or family_for(index.spec.family)  # (a rank's: `ranks/shard.py`)
    whole = [[family.whole_layer(index, i)] for i in range(n)]
    layer_bytes = [slot_size(w[0], direct) for w in whole]
    scratch = scratch_bytes(index, whole, itemsize)
    if sum(layer_bytes) + scratch <= weights:
        resident = tuple(range(n))
        plan = Plan(_loads(whole, set(resident), direct), resident, 0, 0, budget, scratch, reserve)
        return _with_form(plan, index, weights)
    busy: Plan | None = None  # the first plan found, where routing would idle the link
    for ring_budget, min_slots in ((weights // 2, 2), (weights, 2), (weights, 1)):
        for target in _slot_targets(ring_budget, min_slots, max(layer_bytes), index):
            groups = _cut_all(family, index, target, direct)
            if groups is None:
                continue
            ring = _ring(index, groups, layer_bytes, ring_budget, min_slots, weights, direct)
            if ring is None:
                continue
            if ring == "no resident layer":
                break  # half the budget buys no resident layer: give the ring all of it
            n_slots, slot, scratch, resident = ring
            if busy and _held(layer_bytes, resident) < _held(layer_bytes, busy.resident_layers):
                # a smaller resident set streams more than routing's wait costs (and smaller
                # slots, or a larger ring, hold fewer resident layers still)
                return _with_form(busy, index, weights)
            for i in resident:
                if index.quantized:  # all of its slices, in one load
                    groups[i] = [[p for g in groups[i] for p in g]]
                else:  # whole parts: exactly the layer_bytes[i] counted
                    groups[i] = [family.whole_layer(index, i)]
            loads = _loads(groups, resident, direct)
            plan = Plan(loads, tuple(sorted(resident)), n_slots, slot, budget, scratch, reserve)
            if _routing_idles(plan):
                busy = busy or plan
                continue
            return _with_form(plan, index, weights)
    if busy is not None:
        return _with_form(busy, index, weights)
    raise ModelError(f"budget {budget} B cannot hold one slice of a layer; raise --budget")


def _held(layer_bytes: list[int], resident: Iterable[int]) -> int:
    return sum(layer_bytes[i] for i in resident)


def _routing_idles(plan: Plan) -> bool:
    """Whether the link would stand while a streamed layer's router runs: the loader reads
    the next layer's first load then (`streamer._route_of`) where that load's slot is free
    while compute sits at the router's load: where the ring has more slots than the ring
    positions from the router's load to it. The planner takes more, smaller slots for that
    where they keep as large a resident set, else this plan (a layer more to stream costs
    more than a router's wait, a layer's attention compute)."""
    ring = [ld for ld in plan.loads if not ld.resident]
    router_at: int | None = None  # ring position of the last load before routed ones
    for k, load in enumerate(ring):
        if load.routed:
            continue
        if router_at is not None and k > router_at + 1 and k - router_at >= plan.n_slots:
            return True
        router_at = k
    return False


def _with_form(plan: Plan, index: ModelIndex, weights: int) -> Plan:
    """The plan with its resident layers kept dequantized as far as the weight budget's spare
    bytes hold their matrices in the compute dtype (no pass dequantizes those again), largest
    savings first, the rest packed (`loads.resident_floats`)."""
    spare = weights - plan.device_bytes
    itemsize = ITEMSIZE[index.dtype]
    seqs, nbytes = resident_floats(index, plan.loads, spare, itemsize)
    form, _ = resident_form(index, plan.loads, spare, itemsize)
    return replace(plan, resident_form=form, resident_float_bytes=nbytes, resident_floats=seqs)


def _weight_budget(index: ModelIndex, budget: int, reserve: int) -> int:
    """The bytes left for weights; a ModelError when they cannot hold the largest tensor."""
    if reserve >= budget:
        raise ModelError(
            f"budget {budget} B leaves nothing for weights after {reserve} B of activations;"
            " raise --budget or lower --max-prompt-tokens"
        )
    weights = budget - reserve
    largest = max(e.nbytes for layer in index.layers for e in layer.values())
    if weights < largest:
        raise ModelError(
            f"budget {budget} B ({weights} B after {reserve} B of activations) is smaller than"
            f" the largest tensor ({largest} B); raise --budget"
        )
    return weights


def _slot_targets(ring_budget: int, min_slots: int, layer: int, index: ModelIndex) -> list[int]:
    """Slot sizes to try, largest first; the first that fits `min_slots` wins: a whole layer
    (`layer` bytes) if two fit, else loads of a RING_LOADS-th of the ring (then of a
    min_slots-th). A quantized model may need smaller slices still, to leave room for their
    scratch; a mixture of experts smaller loads in more slots (`_routing_idles`)."""
    top = ring_budget // min_slots
    targets = [layer] if layer <= top else []
    targets += [ring_budget // max(min_slots, RING_LOADS), top]
    while index.quantized and top > MIN_SLICE:  # slices cut tensors: smaller than the largest
        top = top * 3 // 4  # in small steps: the scratch of a slice changes by whole rows
        targets.append(top)
    if index.spec.moe is not None:
        targets += [ring_budget // k for k in range(RING_LOADS + 1, 2 * RING_LOADS + 1)]
    return targets


def _cut_all(
    family: PrefillFamily, index: ModelIndex, target: int, direct: bool
) -> list[list[list[Part]]] | None:
    """Every layer's loads of at most `target` bytes; None at the first layer that cannot."""
    groups: list[list[list[Part]]] = []
    for i in range(index.spec.num_layers):
        if (layer := family.layer_groups(index, i, target, direct)) is None:
            return None
        groups.append(layer)
    return groups


def _ring(
    index: ModelIndex, groups: list[list[list[Part]]], layer_bytes: list[int],
    ring_budget: int, min_slots: int, weights: int, direct: bool,
) -> tuple[int, int, int, set[int]] | Literal["no resident layer"] | None:  # fmt: skip
    """(slots, slot bytes, scratch bytes, resident layers) for loads cut as `groups`, or None
    where `min_slots` of them and their scratch do not fit the weights' budget."""
    itemsize, quantized = ITEMSIZE[index.dtype], index.quantized
    slot = max(slot_size(g, direct) for layer in groups for g in layer)
    scratch = scratch_bytes(index, groups, itemsize) if quantized else 0
    for rows in TIGHT_TEMP_ROWS if min_slots * slot + scratch > weights else ():
        # then one matrix at a time (see the families), its temporaries in blocks of rows
        scratch = scratch_bytes(index, groups, itemsize, whole_parts=False, temp_rows=rows)
        if min_slots * slot + scratch <= weights:
            break
    if min_slots * slot + scratch > weights:
        return None
    room = min(ring_budget, weights - scratch)  # the scratch comes out of the budget
    cap = MAX_RING_SLOTS if slot >= max(layer_bytes) else 2 * RING_LOADS
    n_slots = max(min_slots, min(cap, room // slot))
    if quantized:  # resident layers keep their slices: sizes as laid out that way
        sizes = [slot_size([p for g in layer for p in g], direct) for layer in groups]
    else:
        sizes = layer_bytes
    resident = _resident_set(sizes, weights - n_slots * slot - scratch)
    if not resident and ring_budget < weights:
        return "no resident layer"
    return n_slots, slot, scratch, resident
