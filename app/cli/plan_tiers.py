"""The three tiers of `tandem plan`: where the weights live during a warm pass — the device
(the resident set; the ring is only a window), system RAM (the RAM tier, `--host-budget`) and
the disk (the rest of the streamed set, read every pass).

`--host-budget auto` (the default) is what a node would take: this machine's spare RAM
(`nodes/prefill/planning/ram.py`) when planning for a device here; for another machine's card
(no GPU here) the whole streamed set is assumed to fit its RAM — give a size, or 0, to say
otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.nodes.contract.units import format_bytes
from tandem.nodes.prefill.planning.ram import DEFAULT_HOST_BUDGET, HOST_BUDGET_HELP, host_budget_arg

if TYPE_CHECKING:
    from tandem.nodes.prefill.planning.plan import Plan


def add_host_budget_argument(p: argparse.ArgumentParser) -> None:
    help = HOST_BUDGET_HELP + "; for a card not here, auto assumes the whole streamed set fits"
    p.add_argument("--host-budget", type=host_budget_arg, default=DEFAULT_HOST_BUDGET, help=help)


@dataclass(frozen=True)
class Tiers:
    """Weight bytes by tier for one warm pass (JSON: bytes)."""

    device_bytes: int  # resident on the device, never streamed
    ram_bytes: int  # streamed each pass from the RAM tier
    disk_bytes: int  # streamed each pass from disk
    host_budget_bytes: int  # the RAM tier's size as asked for (auto: as resolved)
    host_budget_source: str  # "given", "measured" (this machine's spare RAM) or "assumed"


def with_tiers(
    plan: Plan, host_budget: int | str, device: str, here: bool, held: tuple[int, int] = (0, 0)
) -> tuple[Plan, Tiers]:
    """The plan with its RAM tier as a node would size it, and its three tiers. `held`: a
    request's K/V bytes per token and its longest prompt (what it holds in RAM beside the
    tier, with the node's default prefix cache)."""
    from tandem.nodes.prefill.planning.ram import beside_tier, tier_bytes
    from tandem.nodes.prefill.stream.movers import N_STAGING

    streamed = sum(ld.nbytes for ld in plan.loads if not ld.resident)
    if host_budget != "auto":
        size, source = tier_bytes(int(host_budget), streamed), "given"
    elif not here:
        size, source = streamed, "assumed"
    else:  # as engine.py: what the node takes from RAM beside the tier
        base = N_STAGING * plan.slot_bytes if device == "cuda" else plan.budget_bytes
        beside, _ = beside_tier(base, *held, "auto")
        size, source = tier_bytes("auto", streamed, beside), "measured"
    plan = plan.with_host(size) if size else plan
    tiers = Tiers(plan.resident_bytes, plan.ram_bytes, plan.disk_bytes, size, source)
    return plan, tiers


def render_tiers(t: Tiers) -> str:
    """One line of the human table."""
    tag = "" if t.host_budget_source == "given" else f", {t.host_budget_source}"
    return (
        f"  tiers       device {format_bytes(t.device_bytes)} resident; per pass "
        f"{format_bytes(t.ram_bytes)} from RAM (tier {format_bytes(t.host_budget_bytes)}{tag}),"
        f" {format_bytes(t.disk_bytes)} from disk"
    )
