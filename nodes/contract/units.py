"""Sizes and rates as users type them (DESIGN.md "Units")."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_MULT = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """`512MiB`, `12GiB` (2^30), `2GB` (10^9) or plain bytes → bytes. Raises ValueError."""
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 12GiB, 2GB or a byte count)")
    return int(float(m.group(1)) * _MULT[(m.group(2) or "").upper()])


def format_bytes(n: float) -> str:
    """Human size in binary units: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def gbps_to_Bps(gbps: float) -> float:
    """Link rate in 10^9 bits/s → bytes/s."""
    return gbps * 1e9 / 8
