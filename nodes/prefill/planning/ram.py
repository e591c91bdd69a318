"""The RAM tier's size (`--host-budget`): system RAM as the second tier, between the device
and the disk (seeds 002, 003: the device for what pays most, RAM next, storage last).

`auto` (the default) keeps as much of the streamed set in RAM as this machine can spare: what
the kernel says is available (`MemAvailable`), less room left for the OS and everything else
(`max(OS_RESERVE_MIN, OS_RESERVE_SHARE of MemTotal)`), less what the node itself still takes
from RAM beside the tier (`elsewhere`: on CUDA the pinned staging; on a CPU, where the
"device" *is* RAM, the whole device budget too; and what requests hold there: the prefix
cache, and a prompt's K/V twice, its handover copies and its prefix's upload). The disk is
then read once, on the first pass, and every later pass is bound by the link. `0` turns the
tier off; a size caps it.

The prefix cache (`--prefix-cache`, issue 46) is sized first: `auto` takes a quarter of what
RAM can spare beside the device budget (at least 1 GiB where RAM has it), so a long
conversation's K/V stays cached and its next turn prefills only its new tokens.

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
PREFIX_CACHE_HELP = (
    "RAM for recent prompts' K/V, so a conversation's next turn prefills only its new tokens:"
    " 'auto' (default: a quarter of what RAM can spare), 0 (off) or a size, e.g. 8GiB"
)
PREFIX_SHARE = 0.25  # of the spare RAM, for `--prefix-cache auto`
PREFIX_MIN = 1 << 30  # bytes `auto` takes at least, where RAM can spare them
PREFIX_UNKNOWN = 1 << 30  # bytes `auto` takes where the machine does not say what it has
MEMINFO = Path("/proc/meminfo")
REQUEST_TOKENS = 8192  # a request's prompt, for what it holds in RAM, where nothing bounds it


def parse_host_budget(text: str, flag: str = "--host-budget") -> HostBudget:
    """`auto`, `0` or a size (`16GiB`); ValueError with a one-line message otherwise."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        n = parse_size(text)
    except ValueError:
        msg = f"{flag} takes 'auto', 0 or a size like 16GiB, not {text!r}"
        raise ValueError(msg) from None
    if n < 0:
        raise ValueError(f"{flag} cannot be negative: {text!r}")
    return n


def host_budget_arg(text: str) -> HostBudget:
    """argparse's `type=` for `--host-budget`."""
    try:
        return parse_host_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prefix_cache_arg(text: str) -> HostBudget:
    """argparse's `type=` for `--prefix-cache`."""
    try:
        return parse_host_budget(text, "--prefix-cache")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prefix_cache_bytes(
    budget: HostBudget, elsewhere: int = 0, meminfo: tuple[int, int] | None = None
) -> int:
    """The prefix cache's bytes: a size as asked; `auto`, a quarter of what RAM can spare
    beside `elsewhere` (at least PREFIX_MIN where it can spare that)."""
    if budget != "auto":
        return budget
    info = meminfo if meminfo is not None else read_meminfo()
    if info is None:
        return PREFIX_UNKNOWN
    spare = spare_ram(elsewhere, info)
    return min(spare, max(PREFIX_MIN, int(PREFIX_SHARE * spare)))


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


def beside_tier(
    base: int, kv_bytes_per_token: int, request_tokens: int, prefix_cache: HostBudget | None
) -> tuple[int, int | None]:
    """(RAM the node takes beside the tier, the prefix cache's bytes): `base` (the staging, or
    a CPU's device budget), a request's prompt K/V twice (its handover copies, its prefix's
    upload) at `request_tokens`, and the prefix cache (None: not sized here, not counted)."""
    held = 2 * kv_bytes_per_token * request_tokens
    cache = prefix_cache_bytes(prefix_cache, base + held) if prefix_cache is not None else None
    return base + held + (cache or 0), cache


def request_tokens(max_prompt_tokens: int | None, context: int) -> int:
    """The longest prompt a request brings, for what it holds in RAM: the activation
    reserve's, else the model's context up to REQUEST_TOKENS."""
    return max_prompt_tokens or min(context, REQUEST_TOKENS)
