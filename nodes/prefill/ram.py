"""The RAM tier's size (`--host-budget`): system RAM as the second tier, between the device
and the disk (seeds 002, 003: the device for what pays most, RAM next, storage last).

`auto` (the default) keeps as much of the streamed set in RAM as this machine can spare: what
the kernel says is available (`MemAvailable`), less room left for the OS and everything else
(`max(OS_RESERVE_MIN, OS_RESERVE_SHARE of MemTotal)`), less what the node itself still takes
from RAM beside the tier (`elsewhere`: on CUDA the pinned staging; on a CPU, where the
"device" *is* RAM, the whole device budget too). The disk is then read once, on the first
pass, and every later pass is bound by the link. `0` turns the tier off; a size caps it.

Stdlib only: the CLI parses the flag without importing torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from tandem.nodes.contract.units import parse_size

HostBudget = int | Literal["auto"]  # bytes, or "auto"
DEFAULT_HOST_BUDGET: HostBudget = "auto"
OS_RESERVE_MIN = 2 << 30  # bytes always left free for the OS, the page cache, other programs
OS_RESERVE_SHARE = 0.10  # of MemTotal, when that is more
HOST_BUDGET_HELP = (
    "system RAM that keeps streamed layers across requests: 'auto' (default: what free RAM"
    " allows, room left for the OS), 0 (off: every pass reads the disk) or a size, e.g. 16GiB"
)
MEMINFO = Path("/proc/meminfo")


def parse_host_budget(text: str) -> HostBudget:
    """`auto`, `0` or a size (`16GiB`); ValueError with a one-line message otherwise."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        n = parse_size(text)
    except ValueError:
        msg = f"--host-budget takes 'auto', 0 or a size like 16GiB, not {text!r}"
        raise ValueError(msg) from None
    if n < 0:
        raise ValueError(f"--host-budget cannot be negative: {text!r}")
    return n


def host_budget_arg(text: str) -> HostBudget:
    """argparse's `type=` for `--host-budget`."""
    try:
        return parse_host_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def read_meminfo(path: Path = MEMINFO) -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes, or None where the kernel does not say (not Linux)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key in ("MemTotal", "MemAvailable") and fields:
            values[key] = int(fields[0]) * 1024  # kB
    if "MemTotal" not in values or "MemAvailable" not in values:
        return None
    return values["MemTotal"], values["MemAvailable"]


def spare_ram(elsewhere: int = 0, meminfo: tuple[int, int] | None = None) -> int:
    """Bytes of RAM the tier may take now: available, less the OS's room and `elsewhere`
    (what the node takes from RAM beside the tier); 0 where the machine does not say."""
    info = meminfo if meminfo is not None else read_meminfo()
    if info is None:
        return 0
    total, available = info
    reserve = max(OS_RESERVE_MIN, int(OS_RESERVE_SHARE * total))
    return max(0, available - reserve - elsewhere)


def tier_bytes(
    budget: HostBudget | None, streamed: int, elsewhere: int = 0,
    meminfo: tuple[int, int] | None = None,
) -> int:  # fmt: skip
    """The RAM tier's size in bytes for `streamed` bytes of streamed loads: all of them when
    the budget (or, for `auto`, the spare RAM) allows, else as much as it does; None or 0:
    no tier."""
    if not budget or not streamed:
        return 0
    cap = spare_ram(elsewhere, meminfo) if budget == "auto" else budget
    return min(streamed, cap)
