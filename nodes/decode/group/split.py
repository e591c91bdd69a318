"""Which layers each rank of a decode group holds: contiguous ranges, sized by each rank's
memory, in mlx-lm's pipeline order (rank 0 holds the last layers, the last rank the first:
the hidden state goes from rank size-1 down to rank 0, which samples). Stdlib only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a decode group (its `/health` entry)."""

    rank: int
    host: str
    layers: tuple[int, int]  # [first, end): the layers it holds
    weight_bytes: int  # the weights it loaded: its layers, the embedding, final norm and head
    mem_bytes: int  # the memory it has for them


def split_layers(layers: int, mem: Sequence[int]) -> list[int]:
    """Layer counts per rank, proportional to `mem` (bytes per rank), at least one each, by
    the largest remainder; ValueError where there are more ranks than layers."""
    ranks = len(mem)
    if not 1 <= ranks <= layers:
        raise ValueError(f"{ranks} ranks cannot share {layers} layers (one each at least)")
    if any(m <= 0 for m in mem):
        raise ValueError(f"every rank needs memory, got {list(mem)}")
    spare = layers - ranks  # beyond the one layer each rank holds
    total = sum(mem)
    exact = [spare * m / total for m in mem]
    counts = [1 + int(e) for e in exact]
    by_remainder = sorted(range(ranks), key=lambda r: (int(exact[r]) - exact[r], r))
    for r in by_remainder[: layers - sum(counts)]:
        counts[r] += 1
    return counts


def ranges(split: Sequence[int]) -> list[tuple[int, int]]:
    """Each rank's [first, end) for layer counts `split` (rank 0 the last layers)."""
    out = []
    for r, count in enumerate(split):
        first = sum(split[r + 1 :])
        out.append((first, first + count))
    return out
