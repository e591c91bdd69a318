"""`tandem plan`'s rates: each one given by a flag, or measured here, or assumed (the LAN,
the Mac), and which of the three (`source`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.app.cli.errors import UsageError
from tandem.nodes.contract.units import gbps_to_Bps
from tandem.nodes.model.index import ModelIndex

if TYPE_CHECKING:
    from tandem.nodes.prefill.planning.cost import Device, Hardware

DEFAULT_NET_GBPS = 10.0  # assumed: a 10 GbE LAN (Gbit/s, as --link-gbps)
# assumed: a Mac Studio class GPU (M2 Ultra: ~27 TFLOP/s fp16 peak) at about half of it in
# mlx's prefill; its tokens/s is this over 2 FLOPs per weight
DEFAULT_MAC_FLOPS = 13.5e12


class PlanUsageError(UsageError):
    """Bad input to `tandem plan`: the CLI's one-line exit-2 message."""


def hardware(
    index: ModelIndex, a: argparse.Namespace, device: Device, here: bool
) -> tuple[Hardware, dict[str, str]]:
    """Rates from the flags; each one left out measured here (`source` says which)."""
    from tandem.nodes.prefill.planning import cost

    if not here and (a.pcie_gbps is None or a.tflops is None):
        raise PlanUsageError("--device cuda: no GPU here to measure; give --pcie-gbps and --tflops")
    spec, dtype = index.spec, index.dtype
    source = {
        "copy_Bps": "given" if a.pcie_gbps else "measured",
        "disk_Bps": "given" if a.disk_gbps else "measured",
        "flops": "given" if a.tflops else "measured",
        "net_Bps": "given" if a.net_gbps else "assumed",
        "mac_tok_s": "given" if a.mac_tok_s else "assumed",
    }
    recurrence = dequant = None  # the delta rule's rate, dequantization's: None where none
    if a.tflops:  # one rate for all compute; memory-bound ops taken as free beside it
        flops, attn, elementwise, overhead = a.tflops * 1e12, None, None, 1.0
    else:
        flops = cost.measure_flops(device, dtype, spec.hidden_size)
        attn = cost.measure_attention_flops(device, dtype, spec)
        elementwise = cost.measure_elementwise_Bps(device, dtype, spec)
        overhead = cost.measure_overhead(device, dtype, spec, flops, attn, elementwise)
        recurrence = cost.measure_recurrence_flops(device, dtype, spec)
        dequant = cost.measure_dequant_Bps(device, dtype, spec)
    hw = cost.Hardware(
        device=device,
        copy_Bps=gbps_to_Bps(a.pcie_gbps) if a.pcie_gbps else cost.measure_copy_Bps(device),
        disk_Bps=gbps_to_Bps(a.disk_gbps) if a.disk_gbps else _disk_Bps(index, a.model, device),
        flops=flops,
        net_Bps=gbps_to_Bps(a.net_gbps or DEFAULT_NET_GBPS),
        mac_tok_s=a.mac_tok_s or DEFAULT_MAC_FLOPS / (2 * _layer_params(index)),
        attn_flops=attn,
        elementwise_Bps=elementwise,
        overhead=overhead,
        recurrence_flops=recurrence,
        dequant_Bps=dequant,
    )
    return hw, source


def _disk_Bps(index: ModelIndex, model: Path, device: Device) -> float:
    """Read rate of the weights' file system, as the device's loader gets it."""
    from tandem.nodes.prefill.planning import cost

    busy, nice = cost.loader_contention(device, index.dtype, index.spec)
    try:
        return cost.measure_disk_Bps(model, busy=busy, nice=nice)
    except OSError as e:
        raise PlanUsageError(f"cannot measure the disk here ({e}); give --disk-gbps") from None


def _layer_params(index: ModelIndex) -> int:
    """Weights one token passes through (the decoder layers), in values."""
    spec = index.spec
    attn = 2 * spec.hidden_size * spec.head_dim * (spec.num_heads + spec.num_kv_heads)
    return spec.num_layers * (attn + 3 * spec.hidden_size * spec.intermediate_size)
