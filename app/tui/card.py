"""The card's own counters as the dashboard writes them: a prefill node's `/health` `gpu`
(NVML's, nodes/contract/gauges.py) beside tandem's own host→device count. Pure, no Textual;
'' wherever `/health` says nothing."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.app.tui.fmt import format_rate
from tandem.nodes.contract.gauges import Gauges


def pcie(gen: float | None, width: float | None) -> str:
    return f"Gen{gen:.0f} x{width:.0f}" if gen is not None and width is not None else ""


def below_max(gpu: Gauges) -> bool:
    """Whether the link runs slower or narrower now than the card and slot can (an idle card
    drops its generation: a busy one should not)."""
    gen, width = gpu.get("link_gen"), gpu.get("link_width")
    gen_max, width_max = gpu.get("link_gen_max"), gpu.get("link_width_max")
    if gen is None or width is None or gen_max is None or width_max is None:
        return False
    return gen < gen_max or width < width_max


def link_text(gpu: Gauges) -> str:
    """The link as negotiated, `Gen4 x16`; below its maximum `Gen3 x4 / max Gen4 x16`."""
    now = pcie(gpu.get("link_gen"), gpu.get("link_width"))
    if now and below_max(gpu):
        return f"{now} / max {pcie(gpu.get('link_gen_max'), gpu.get('link_width_max'))}"
    return now


def card_text(gpus: Sequence[Gauges]) -> str:
    """One line under host→device: what the card received over PCIe (NVML's last 20 ms
    when `/health` was read) and its link now; several cards: their sum."""
    rx = [g["pcie_rx_Bps"] for g in gpus if "pcie_rx_Bps" in g]
    if len(gpus) > 1:
        return f"{len(gpus)} cards {format_rate(sum(rx))}" if rx else ""
    if not gpus:
        return ""
    link = pcie(gpus[0].get("link_gen"), gpus[0].get("link_width"))
    return " · ".join(p for p in (f"card {format_rate(rx[0])}" if rx else "", link) if p)
