"""One section in a child process of its own: its JSON is the last line on stdout."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from .attention import attention_section
from .big_model import model_section, small_card_section
from .context import Ctx
from .device import env_section, h2d_section
from .families import dequant_section, families_section
from .host import host_section
from .kv import kv_section
from .memory import memory_section
from .overlap import bench_section
from .quantized import quantized_section
from .race import race_section
from .ranks import ranks_section
from .report import clean
from .requests import requests_section
from .sanitizer import planted_section, sanitized_section
from .sizes import CUDA_SIZES, SMOKE_SIZES, Json

SECTIONS: dict[str, Callable[[Ctx], Json]] = {
    "env": env_section,
    "h2d": h2d_section,
    "model": model_section,
    "attention": attention_section,
    "kv": kv_section,
    "requests": requests_section,
    "quantized": quantized_section,
    "race": race_section,
    "ranks": ranks_section,
    "sanitized": sanitized_section,
    "planted": planted_section,
    "memory": memory_section,
    "small_card": small_card_section,
    "bench": bench_section,
    "families": families_section,
    "dequant": dequant_section,
    "host": host_section,
}


def child_main(name: str, smoke: bool, work: Path) -> int:
    """Run one section; its JSON is the last line on stdout, whatever happens."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        import torch

        cuda = torch.cuda.is_available() and not smoke
        ctx = Ctx(SMOKE_SIZES if smoke else CUDA_SIZES, cuda, work)
        result = SECTIONS[name](ctx)
        result.setdefault("ok", True)
    except Exception as e:
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
            "traceback": traceback.format_exc().splitlines()[-8:],
        }
    print(json.dumps(clean(result), default=str), flush=True)
    return 0
