"""How the dashboard writes rates and times (DESIGN.md "Units": JSON carries bytes/s)."""

from __future__ import annotations


def format_rate(Bps: float) -> str:
    """Bytes/s in decimal units: `512 kB/s`, `12.3 MB/s`, `1.25 GB/s`."""
    if Bps >= 1e9:
        return f"{Bps / 1e9:.2f} GB/s"
    if Bps >= 1e6:
        return f"{Bps / 1e6:.1f} MB/s"
    if Bps >= 1e3:
        return f"{Bps / 1e3:.0f} kB/s"
    return f"{Bps:.0f} B/s"


def format_gbit(Bps: float) -> str:
    """Bytes/s as a link rate in 10^9 bits/s (Ethernet and PCIe are quoted in Gbit)."""
    gbit = Bps * 8 / 1e9
    if gbit >= 10:
        return f"{gbit:.0f} Gbit/s"
    if gbit >= 0.1:
        return f"{gbit:.2f} Gbit/s"
    return f"{gbit * 1000:.1f} Mbit/s"


def format_link(Bps: float) -> str:
    """A link's rate both ways a user reads it: `6.2 MB/s · 0.05 Gbit/s`."""
    return f"{format_rate(Bps)} · {format_gbit(Bps)}"


def format_tok_s(tok_s: float | None) -> str:
    if tok_s is None:
        return "–"
    return f"{tok_s:,.0f} tok/s" if tok_s >= 100 else f"{tok_s:.1f} tok/s"


def format_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def format_size(n: int) -> str:
    """Memory in decimal GB/MB, as vendors label it."""
    if n >= 1e10:
        return f"{n / 1e9:.0f} GB"
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.0f} MB"
    return f"{n / 1e3:.0f} kB"


def format_binary(n: int) -> str:
    """Weights in binary units, as `tandem plan` and the logs give them: `1.2 GiB`, `640 MiB`."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.0f} MiB" if n >= 10 << 20 else f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.0f} KiB"
