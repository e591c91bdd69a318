"""A node's gauges in `/health` (issue 51): the card's own counters on a CUDA prefill node
(`gpu`, read through NVML by nodes/prefill/measure/nvml.py) and mlx's memory on a decode
node (`mlx_memory`, nodes/decode/memory.py), each an object of numbers or `null`.

Each gauge table maps a key to what it measures (its unit in the name: `_Bps` bytes/s,
`_bytes`, `_pct`, `_c`, `_w`), for `/health` readers and for `/metrics` help texts alike. A key
absent from a body means unknown (that counter is not supported there). A reader keeps every
entry whose value is a number, a newer node's keys too, and leaves out any other, so neither
an older nor a newer node's body breaks it. Stdlib only.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.nodes.contract.http import ContractError

Gauges = dict[str, int | float]  # key → value, only the keys known at the node

GPU_GAUGES: dict[str, str] = {
    "pcie_rx_Bps": "bytes/s the card received over PCIe (host→device), NVML's last 20 ms",
    "pcie_tx_Bps": "bytes/s the card sent over PCIe (device→host), NVML's last 20 ms",
    "link_gen": "PCIe generation the link runs at now (an idle card drops to a lower one)",
    "link_width": "PCIe lanes the link runs on now",
    "link_gen_max": "highest PCIe generation this card and slot can run at",
    "link_width_max": "most PCIe lanes this card and slot can run on",
    "util_pct": "percent of the last sample period a kernel ran on the card",
    "mem_used_bytes": "device memory in use, every process's",
    "mem_total_bytes": "device memory in all",
    "temp_c": "GPU temperature, degrees Celsius",
    "power_w": "power drawn by the card, watts",
}
MLX_MEMORY_GAUGES: dict[str, str] = {
    "active_bytes": "memory mlx's arrays hold now",
    "peak_bytes": "most memory mlx's arrays held since the process started",
    "cache_bytes": "memory mlx keeps cached for reuse, not held by arrays",
    "wired_limit_bytes": "the system's wired limit, what mlx-lm wires while it generates",
}


def read_gauges(obj: dict[str, Any], key: str, what: str) -> Gauges | None:
    """`obj[key]` as gauges: None when absent or null (an older node, or another role); a
    value that is not an object is a ContractError; entries that are not finite numbers are
    left out."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ContractError(f"{what} {key} is not a JSON object")
    return {
        k: v
        for k, v in value.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
