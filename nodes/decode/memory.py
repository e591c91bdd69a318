"""mlx's memory on the decode node, for `/health`'s `mlx_memory` (nodes/contract/gauges.py).

Read from any thread, not only the mlx one: `get_active_memory`, `get_peak_memory` and
`get_cache_memory` return the allocator's counters (plain reads, no lock, no stream, nothing
evaluated), and `device_info` is a dict made once. So a health check never waits behind a
decode step on the mlx thread.

mlx has no getter for the wired limit (`set_wired_limit` returns the one it replaces, and
changing it during an eval is unsafe); its documented stand-in is the system's limit,
`device_info()["max_recommended_working_set_size"]`, which is what mlx-lm wires while a
reply generates (lm.py `wired`). mlx without Metal (Linux's mlx[cpu]) has no such key: None.
"""

from __future__ import annotations

import mlx.core as mx
from tandem.nodes.contract.gauges import Gauges


def mlx_memory() -> Gauges:
    """`active_bytes`, `peak_bytes`, `cache_bytes` and `wired_limit_bytes` (bytes); a key this
    mlx cannot say is left out."""
    out: Gauges = {
        "active_bytes": int(mx.get_active_memory()),
        "peak_bytes": int(mx.get_peak_memory()),
        "cache_bytes": int(mx.get_cache_memory()),
    }
    wired = mx.device_info().get("max_recommended_working_set_size")
    if isinstance(wired, int) and wired > 0:
        out["wired_limit_bytes"] = wired
    return out
