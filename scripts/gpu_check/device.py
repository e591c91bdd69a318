"""The `env` and `h2d` sections: versions, the device, and host→device copy rates."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from .context import Ctx, say
from .sizes import Json


def env_section(ctx: Ctx) -> Json:
    """Versions, the device and its free memory."""
    import numpy as np
    import torch

    cuda = torch.cuda.is_available()
    out: Json = {
        "cuda": cuda,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "cpu_count": os.cpu_count(),
        "host_mem_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out |= {
            "device_count": torch.cuda.device_count(),
            "device": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "free_bytes": free,
            "total_bytes": total,
        }
        smi = shutil.which("nvidia-smi")
        if smi:
            query = "driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current"
            done = subprocess.run(
                [smi, f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            out["nvidia_smi"] = {"query": query, "answer": done.stdout.strip()}
    return out


def h2d_section(ctx: Ctx) -> Json:
    """Host→device GB/s of one big copy from pinned and from pageable memory (and back)."""
    import statistics

    import torch

    n = ctx.sizes.h2d_bytes
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - t0
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned.fill_(1)
    pageable.fill_(1)  # fault its pages in before timing

    def rate(dst: torch.Tensor, src: torch.Tensor, reps: int = 5) -> Json:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        seconds = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            seconds.append(a.elapsed_time(b) / 1000)
        return {"best_Bps": n / min(seconds), "median_Bps": n / statistics.median(seconds)}

    out = {
        "bytes": n,
        "pin_s": pin_s,
        "pinned": rate(dev, pinned),
        "pageable": rate(dev, pageable),
        "d2h_pinned": rate(pinned, dev),
    }
    say(
        f"h2d pinned {out['pinned']['best_Bps'] / 1e9:.1f} GB/s, "
        f"pageable {out['pageable']['best_Bps'] / 1e9:.1f} GB/s"
    )
    return out
