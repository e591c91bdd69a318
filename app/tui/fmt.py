"""How the dashboard writes rates and times (DESIGN.md "Units": JSON carries bytes/s)."""

from __future__ import annotations

from tandem.nodes.contract.units import gbps_to_Bps

# A scale: rows of (from, unit size, decimals, unit name), largest first; a value is written
# in the first row it reaches (the last row also takes what reaches none, negatives and NaN).
_Scale = tuple[tuple[float, float, int, str], ...]
_RATE: _Scale = (
    (1e9, 1e9, 2, "GB/s"),
    (1e6, 1e6, 1, "MB/s"),
    (1e3, 1e3, 0, "kB/s"),
    (float("-inf"), 1, 0, "B/s"),
)
_SIZE: _Scale = (
    (1e10, 1e9, 0, "GB"),
    (1e9, 1e9, 1, "GB"),
    (1e6, 1e6, 0, "MB"),
    (float("-inf"), 1e3, 0, "kB"),
)
_BINARY: _Scale = (
    (1 << 30, 1 << 30, 1, "GiB"),
    (10 << 20, 1 << 20, 0, "MiB"),
    (1 << 20, 1 << 20, 1, "MiB"),
    (float("-inf"), 1024, 0, "KiB"),
)


def _on_scale(x: float, scale: _Scale) -> str:
    _, size, decimals, unit = next((row for row in scale if x >= row[0]), scale[-1])
    return f"{x / size:.{decimals}f} {unit}"


def format_rate(Bps: float) -> str:
    """Bytes/s in decimal units: `512 kB/s`, `12.3 MB/s`, `1.25 GB/s`."""
    return _on_scale(Bps, _RATE)


def format_gbit(Bps: float) -> str:
    """Bytes/s as a link rate in 10^9 bits/s (Ethernet and PCIe are quoted in Gbit)."""
    gbit = Bps / gbps_to_Bps(1.0)
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
    return _on_scale(n, _SIZE)


def format_binary(n: int) -> str:
    """Weights in binary units, as `tandem plan` and the logs give them: `1.2 GiB`, `640 MiB`."""
    return _on_scale(n, _BINARY)
