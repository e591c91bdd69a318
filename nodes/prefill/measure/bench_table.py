"""`tandem bench prefill`'s table: the JSON result for a reader."""

from __future__ import annotations


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _gbs(rate: object) -> str:
    return f"{rate / 1e9:.2f} GB/s" if isinstance(rate, float) else "-"


def table(r: dict[str, object]) -> str:
    lines = [
        f"tandem bench prefill — {r['tokens']} tokens on {r['device']}, "
        f"budget {_fmt(r['budget_bytes'])} of a {_fmt(r['model_bytes'])} model"
        + (", cold page cache" if r["cold"] else ""),
        f"  wall        {r['wall_s']:.3f} s   ({r['tokens_per_s']:.0f} tokens/s)",
        f"  load only   {r['load_s']:.3f} s   (link {r['link_gbps'] or 'unthrottled'} Gbit/s)",
        f"  loader      {_gbs(r['loader_Bps'])} (disk {_gbs(r['disk_Bps'])}, "
        f"copy {_gbs(r['copy_Bps'])})",
        f"  compute     {r['compute_s']:.3f} s",
        f"  overlap     {r['overlap_ratio']:.3f}   (wall / max(load, compute); 1.0 is ideal)",
        f"  sequential  {r['sequential_ratio']:.3f}   (wall / (load + compute))",
        f"  weights     peak {_fmt(r['peak_weight_bytes'])}, streamed {_fmt(r['bytes_streamed'])}"
        f" per pass: {_fmt(r['ram_bytes'])} from RAM, {_fmt(r['disk_bytes'])} from disk"
        f" (RAM tier {_fmt(r['ram_tier_bytes'])})",
        f"  activations {_fmt(r['peak_activation_bytes'])}; "
        f"peak RSS +{_fmt(r['peak_rss_delta_bytes'])}",
    ]
    if r.get("quantize_s") is not None:
        lines.append(
            f"  quantize    {r['quantize_s']:.3f} s  ({r['quantize_share']:.1%} of wall, "
            f"{r['kv_bits']}-bit KV for the wire)"
        )
    if "vs_resident_ratio" in r:
        lines.append(
            f"  resident    {r['resident_wall_s']:.3f} s all resident; streamed / resident"
            f" {r['vs_resident_ratio']:.3f} (turn by turn, median)"
        )
    if "batch_ratio" in r:
        lines.append(
            f"  batch       {r['batch']} prompts in one pass {r['batch_wall_s']:.3f} s,"
            f" {_fmt(r['batch_bytes'])}; {r['batch']} lone {r['lone_wall_s']:.3f} s,"
            f" {_fmt(r['lone_bytes'])}; one / lone {r['batch_ratio']:.3f} (turn by turn, median)"
        )
    if r.get("experts_streamed"):
        lines.append(
            f"  experts     {r['experts_streamed']} read ({r['experts']}); the link waited"
            f" {r['route_wait_s']:.3f} s for routers"
        )
    if "vs_all_experts_ratio" in r:
        lines.append(
            f"  all experts {r['all_experts_wall_s']:.3f} s, {_fmt(r['all_experts_bytes'])};"
            f" routed / all {r['vs_all_experts_ratio']:.3f}"
            f" ({_fmt(r['routed_bytes'])} routed; turn by turn, median)"
        )
    if "accelerate_wall_s" in r:
        lines.append(
            f"  accelerate  {r['accelerate_wall_s']:.3f} s, peak RSS "
            f"+{_fmt(r['accelerate_peak_rss_delta_bytes'])}  "
            f"(tandem is {r['accelerate_wall_s'] / r['wall_s']:.1f}x faster)"
        )
    return "\n".join(lines)
