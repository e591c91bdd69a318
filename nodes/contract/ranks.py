"""A prefill node run as several ranks (`torchrun`, issue 52) as `/health` tells it: each rank
a device streaming its share of every layer. Stdlib only; one parser, `read_prefill_ranks`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.nodes.contract.fields import read_int, read_object, read_rate, read_str
from tandem.nodes.contract.http import ContractError


@dataclass(frozen=True)
class PrefillRank:
    """One rank: its device and budget, its link's rate (None: not measured), its share of
    the weights by tier, and its last pass."""

    rank: int
    device: str
    budget_bytes: int
    link_gbps: float | None
    resident_layers: tuple[int, ...]
    weight_bytes: int  # its share of every layer
    device_bytes: int  # of it, resident on its device
    ram_bytes: int  # read from the RAM tier each pass
    disk_bytes: int  # read from disk each pass
    pass_bytes: int = 0  # streamed in its last pass
    pass_reduced_bytes: int = 0  # its all-reduces' bytes in its last pass
    pass_s: float = 0.0
    pcie: str = ""  # its card's link as NVML says it ("Gen4 x8 (of Gen4 x16)"); "": unknown

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "device": self.device, "budget_bytes": self.budget_bytes,
            "link_gbps": self.link_gbps, "pcie": self.pcie,
            "resident_layers": list(self.resident_layers),
            "weight_bytes": self.weight_bytes, "device_bytes": self.device_bytes,
            "ram_bytes": self.ram_bytes, "disk_bytes": self.disk_bytes,
            "pass_bytes": self.pass_bytes, "pass_reduced_bytes": self.pass_reduced_bytes,
            "pass_s": self.pass_s,
        }  # fmt: skip


@dataclass(frozen=True)
class PrefillRanks:
    """The node's ranks (rank 0 serves); `lost`: why they are broken ("" while they run)."""

    size: int
    backend: str  # "nccl", "gloo"
    ranks: tuple[PrefillRank, ...]
    lost: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "backend": self.backend,
                "ranks": [r.to_json() for r in self.ranks], "lost": self.lost}  # fmt: skip


def read_prefill_ranks(obj: dict[str, Any], what: str) -> PrefillRanks | None:
    """`prefill_ranks`: None from a node of one device (or an older one)."""
    if obj.get("prefill_ranks") is None:
        return None
    g = read_object(obj, "prefill_ranks", what)
    items = g.get("ranks")
    if not isinstance(items, list) or not all(isinstance(r, dict) for r in items):
        raise ContractError(f"{what} prefill_ranks.ranks is not a list of objects")
    ranks = []
    for r in items:
        layers = r.get("resident_layers", [])
        if not isinstance(layers, list) or not all(type(i) is int for i in layers):
            raise ContractError(f"{what} prefill rank's resident_layers is not a list of ints")
        ranks.append(PrefillRank(
            read_int(r, "rank", what), read_str(r, "device", what),
            read_int(r, "budget_bytes", what), read_rate(r, "link_gbps", what), tuple(layers),
            read_int(r, "weight_bytes", what), read_int(r, "device_bytes", what),
            read_int(r, "ram_bytes", what), read_int(r, "disk_bytes", what),
            read_int(r, "pass_bytes", what), read_int(r, "pass_reduced_bytes", what),
            read_rate(r, "pass_s", what) or 0.0, read_str(r, "pcie", what),
        ))  # fmt: skip
    return PrefillRanks(read_int(g, "size", what), read_str(g, "backend", what), tuple(ranks),
                        read_str(g, "lost", what))  # fmt: skip
