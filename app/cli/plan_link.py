"""`tandem plan`'s look at this machine's card: its PCIe link as NVML says it
(nodes/prefill/measure/nvml.py), and one warning line when the link runs below what the card
and slot can do — a x16 card in a x4 slot, or a Gen4 one at Gen3, is the commonest reason a
"25 GB/s" host→device floor is 8.

A card that idles drops its link's generation to save power, so the generation counts only
right after the plan measured a rate on the card (`busy`), and not when the copy it measured
ran faster than that generation carries (the link had already dropped when NVML was read).
The width holds either way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.nodes.prefill.measure.nvml import NvmlReader


@dataclass(frozen=True)
class PcieLink:
    """The card's link (JSON `pcie_link`): as negotiated now, and at most."""

    gen: int
    width: int
    gen_max: int
    width_max: int
    gen_counts: bool  # the card had just worked: `gen` is the link's under load
    cap_Bps: float | None  # the link one way, bytes/s before packet overheads
    below_max: bool  # narrower than it can be, or (where `gen` counts) slower
    warning: str = ""  # the report's line when below its maximum


def pcie_link(busy: bool, copy_Bps: float, reader: NvmlReader | None = None) -> PcieLink | None:
    """This machine's CUDA card's link (device 0, as the plan's), read now; None without
    NVML or a card that says its link. `copy_Bps`: the host→device rate the plan uses."""
    from tandem.nodes.prefill.measure.nvml import link_Bps, reader_for

    reader = reader if reader is not None else reader_for("cuda")
    if reader is None:
        return None
    try:
        reading = reader.read()
    finally:
        reader.close()
    if reading is None:
        return None
    gen, width = reading.link_gen, reading.link_width
    gen_max, width_max = reading.link_gen_max, reading.link_width_max
    if gen is None or width is None or gen_max is None or width_max is None:
        return None
    now_Bps = link_Bps(gen, width)
    counts = busy and not (now_Bps is not None and copy_Bps > 1.05 * now_Bps)
    cap = link_Bps(gen if counts else gen_max, width)
    below = width < width_max or (counts and gen < gen_max)
    link = PcieLink(gen, width, gen_max, width_max, counts, cap, below)
    return replace(link, warning=_warning(link)) if below else link


def _warning(link: PcieLink) -> str:
    near = f": host→device is capped near {link.cap_Bps / 1e9:.2g} GB/s" if link.cap_Bps else ""
    if link.gen_counts:
        return (f"PCIe Gen{link.gen} x{link.width}, the card can do Gen{link.gen_max} "
                f"x{link.width_max}{near}")  # fmt: skip
    return f"PCIe x{link.width}, the card can do x{link.width_max} (Gen{link.gen_max}){near}"


def render_link(link: PcieLink | None) -> list[str]:
    """The report's `link` line: only when the link runs below its maximum."""
    if link is None or not link.warning:
        return []
    return [f"  link        {link.warning}"]
