"""The K/V part of `tandem plan`: what a prompt's K/V costs on the wire at 16, 8 and 4 bits.

Full layers' bytes grow with the prompt (per token); sliding layers' are bounded by their
window (fixed per layer once the prompt passes it); linear layers send no K/V but their state,
the same bytes for any prompt. The parts, and the router's total, come from
`nodes/model/kv_bytes.py`, the one count the decode node's router uses too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tandem.nodes.contract.units import format_bytes
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.kv_bytes import KVBytes, kv_bytes
from tandem.nodes.model.safetensors_format import ITEMSIZE

if TYPE_CHECKING:
    from tandem.app.cli.plan_model import ModelSummary

BITS = (16, 8, 4)


@dataclass(frozen=True)
class KVWire:
    """The K/V of `--tokens` on the wire at `bits` (16: the model's dtype; 8, 4: group 64 on
    full layers, sliding layers and linear layers' state staying as they are)."""

    bits: int
    bytes_per_token: int  # full layers: what grows with the prompt
    window_bytes: int  # sliding layers: at most this, however long the prompt (0: none)
    bytes: int  # the prompt's, both parts
    all_full_bytes: int  # the prompt's, were every layer full
    transfer_s: float  # `bytes` at net_Bps
    state_bytes: int = 0  # linear layers: their state, the same for any prompt (0: none)


def wire_kv(index: ModelIndex, bits: int = 16) -> KVBytes:
    """What each layer of the model sends at `bits`, in its compute dtype."""
    from tandem.nodes.contract.http import KVFormat

    fmt = None if bits == 16 else KVFormat(bits)
    return kv_bytes(index.spec, fmt, ITEMSIZE[index.dtype])


def kv_wire(index: ModelIndex, tokens: int, net_Bps: float) -> list[KVWire]:
    """The prompt's K/V in each format the router counts, and its transfer time."""
    from tandem.nodes.contract.http import KVFormat

    all_full = replace(index.spec, layer_kinds=())  # () reads as every layer full
    out = []
    # attention sinks (gpt-oss), latents (DeepSeek V3): mlx-lm attends over floats only
    for bits in BITS[:1] if index.spec.float_kv else BITS:
        kv = wire_kv(index, bits)
        fmt = None if bits == 16 else KVFormat(bits)
        full = kv_bytes(all_full, fmt, ITEMSIZE[index.dtype]).at(tokens)
        nbytes = kv.at(tokens)
        transfer_s = nbytes / net_Bps
        out.append(
            KVWire(
                bits, kv.full_per_token, kv.window_bytes, nbytes, full, transfer_s, kv.state_bytes
            )
        )
    return out


def render_kv(tokens: int, wires: list[KVWire], m: ModelSummary) -> list[str]:
    """The plan's K/V lines: the parts apart when the model has sliding or linear layers,
    then the prompt's bytes and transfer time per format."""
    if not m.sliding_layers and not m.linear_layers:
        wire = ", ".join(
            f"{w.bits} bits {format_bytes(w.bytes_per_token)}/token {w.transfer_s:.3g} s"
            for w in wires
        )
        return [f"  KV wire     {tokens} tokens: {wire}"]
    sixteen = next(w for w in wires if w.bits == 16)
    full = m.layers - m.sliding_layers - m.linear_layers
    parts = f"  KV          full layers ({full}) {format_bytes(sixteen.bytes_per_token)}/token"
    if m.sliding_layers:
        parts += (
            f", sliding layers ({m.sliding_layers}, window {'/'.join(map(str, m.windows))}) "
            f"at most {format_bytes(sixteen.window_bytes)}"
        )
    if m.linear_layers:
        parts += (
            f", linear layers ({m.linear_layers}) state {format_bytes(sixteen.state_bytes)}"
            " whatever the prompt"
        )
    wire = ", ".join(f"{w.bits} bits {format_bytes(w.bytes)} {w.transfer_s:.3g} s" for w in wires)
    ratio = [f"{w.bytes / w.all_full_bytes:.3f}" if w.all_full_bytes else "-" for w in wires]
    return [
        parts,
        f"  KV wire     {tokens} tokens: {wire}",
        f"              {ratio[0]} of what all-full layers would send at {wires[0].bits} bits"
        + "".join(f", {r} at {w.bits}" for r, w in zip(ratio[1:], wires[1:], strict=True)),
    ]
