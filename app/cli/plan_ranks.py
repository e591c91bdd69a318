"""`tandem plan --devices N`: a prefill node of N cards (torchrun ranks, `prefill/ranks/`), each
streaming and computing its share of every layer over its own PCIe link: each rank's plan
(budget, resident layers, tiers) and predicted pass, the all-reduces between them, and the
pass against one card's.

Each card's link: `--lanes 16` (x16/x16, workstation boards) or `--lanes 8` (x8/x8, most
desktop boards splitting one x16 slot): the host→device rate scales with the lanes from
`--pcie-gbps` (a x16 link's, measured or given). The all-reduces go between the cards over
the same links (no NVLink assumed): two per layer, each [tokens, hidden] in the model dtype,
a ring's 2·(N-1)/N of it through each card's link, waited on by compute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tandem.app.cli.plan_tiers import with_tiers
from tandem.nodes.contract.units import format_bytes

if TYPE_CHECKING:
    from tandem.nodes.model.index import ModelIndex
    from tandem.nodes.prefill.planning.cost import Hardware
    from tandem.nodes.prefill.planning.plan import Plan

FULL_LANES = 16  # the rate `--pcie-gbps` gives is a x16 link's


@dataclass(frozen=True)
class RankPlan:
    rank: int
    device: str  # cuda:0, cuda:1, ... (or the CPU)
    pcie: str  # its card's link here, as NVML reads it ("Gen4 x8 (of Gen4 x16)"); "": not here
    budget_bytes: int
    lanes: int
    copy_Bps: float
    resident_layers: list[int]
    device_bytes: int  # its share of the resident layers
    ram_bytes: int  # per pass from its share of the RAM tier
    disk_bytes: int  # per pass from disk
    weight_bytes: int  # its share of every layer
    predicted_wall_s: float
    bound: str


@dataclass(frozen=True)
class RanksReport:
    """The node of `devices` cards at `tokens` tokens (JSON: bytes, seconds)."""

    devices: int
    lanes: int  # each card's: 16 (x16/x16) or 8 (x8/x8)
    tokens: int
    ranks: list[RankPlan]
    reduce_bytes_per_layer: int  # both all-reduces' [tokens, hidden] tensors
    reduce_s: float  # all of them in a pass, through a card's link
    predicted_wall_s: float  # the slowest rank's pass plus the all-reduces
    one_device_s: float  # one such card with the whole model


def ranks_report(
    index: ModelIndex, plan: Plan, devices: int, lanes: int, tokens: int, hw: Hardware,
    host_budget: int | str, device: str, here: bool, one_device_s: float, longest: int | None,
) -> RanksReport:  # fmt: skip
    """Each rank's plan on the same budget as `plan` (one card's), its RAM tier a share of
    the machine's, and the node's predicted pass."""
    from tandem.nodes.model.safetensors_format import ITEMSIZE
    from tandem.nodes.prefill.families import family_for
    from tandem.nodes.prefill.measure.nvml import link_of
    from tandem.nodes.prefill.planning import cost
    from tandem.nodes.prefill.planning.budget import plan_for_prompts
    from tandem.nodes.prefill.ranks.shard import Shard, sharded

    link = replace(hw, copy_Bps=hw.copy_Bps * lanes / FULL_LANES)
    tier: int | str = host_budget  # the machine's RAM, shared by the ranks
    if host_budget != "auto":
        tier = int(host_budget) // devices
    elif here:  # the machine's spare RAM
        tier = with_tiers(plan, host_budget, device, here)[1].host_budget_bytes // devices
    ranks = []
    for r in range(devices):
        family = sharded(family_for(index.spec.family), Shard(r, devices))
        mine = plan_for_prompts(index, plan.budget_bytes, longest, device, family=family)
        mine, tiers = with_tiers(mine, tier, device, here)
        p = cost.predict(mine, index, tokens, link)
        card = f"cuda:{r}" if device == "cuda" else device
        ranks.append(RankPlan(
            r, card, link_of(card) if here else "", mine.budget_bytes, lanes, link.copy_Bps,
            list(mine.resident_layers),
            tiers.device_bytes, tiers.ram_bytes, tiers.disk_bytes,
            sum(ld.weight_bytes for ld in mine.loads), p.wall_s, p.bound,
        ))  # fmt: skip
    per_layer = 2 * tokens * index.spec.hidden_size * ITEMSIZE[index.dtype]
    ring = 2 * (devices - 1) / devices  # of each tensor, through each card's link
    reduce_s = index.spec.num_layers * per_layer * ring / link.copy_Bps
    wall = max(r.predicted_wall_s for r in ranks) + reduce_s
    return RanksReport(devices, lanes, tokens, ranks, per_layer, reduce_s, wall, one_device_s)


def render_ranks(r: RanksReport) -> list[str]:
    """The human table's lines for the ranks."""
    lanes = "/".join(f"x{r.lanes}" for _ in range(r.devices))
    lines = [
        "",
        f"  {r.devices} devices ({lanes}: each card its own link, a share of every layer; "
        f"torchrun --nproc-per-node {r.devices}, or --devices)",
    ]
    for k in r.ranks:
        layers = ", ".join(map(str, k.resident_layers))
        resident = f"layers {layers}" if layers else "none"
        here = f", here {k.pcie}" if k.pcie else ""
        lines.append(
            f"    rank {k.rank}  {k.device}{here}, budget {format_bytes(k.budget_bytes)}, link "
            f"{k.copy_Bps / 1e9:.3g} GB/s, share {format_bytes(k.weight_bytes)}, resident "
            f"{format_bytes(k.device_bytes)} ({resident}); per pass "
            f"{format_bytes(k.ram_bytes)} from RAM, {format_bytes(k.disk_bytes)} from disk: "
            f"{k.predicted_wall_s:.3g} s, {k.bound}-bound"
        )
    lines.append(
        f"    all-reduce {format_bytes(r.reduce_bytes_per_layer)} a layer, "
        f"{r.reduce_s:.3g} s a pass; {r.tokens} tokens in {r.predicted_wall_s:.3g} s against "
        f"{r.one_device_s:.3g} s on one card ({r.predicted_wall_s / r.one_device_s:.2f}x)"
    )
    return lines
