"""Where to prefill a prompt: here with mlx, or on a trusted prefill node.

`auto` compares predicted times. Both sides have a floor — a pass costs at least one forward
step locally, and at least one stream of the weights through the GPU budget (plus HTTP and
cache assembly) remotely — and a rate beyond it:

    local  = max(local_floor, n / local_rate)
    remote = latency + max(remote_floor, n / remote_rate, kv_bytes / link) + kv_bytes / link / L

(layers stream while the next computes, so compute and transfer overlap; the last layer's
transfer does not), plus the wait it would join: the prefills ahead of it on that node (its
`/health` queue at the last check, or what this node has in flight there, the larger), each a
floor and its tokens at the node's rate. `kv_bytes` counts a sliding layer's window, not the
whole prompt, and a linear layer's state, the same for any prompt (`nodes/model/kv_bytes.py`,
as `tandem plan` does). Rates and floors come from a start-up
calibration and past requests; an unmeasured remote rate counts as promising (a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from tandem.nodes.contract.cluster import Peer
from tandem.nodes.contract.units import gbps_to_Bps
from tandem.nodes.model.kv_bytes import KVBytes

Mode = Literal["auto", "always", "never"]
DEFAULT_LATENCY_S = 0.002
OPTIMISTIC_REMOTE_TOK_S = 5000.0
OPTIMISTIC_LINK_BPS = gbps_to_Bps(1.0)  # bytes/s: 1 Gbit/s


@dataclass(frozen=True)
class Decision:
    where: Literal["local", "remote"]
    peer: Peer | None
    reason: str
    local_s: float | None = None
    remote_s: float | None = None


@dataclass(frozen=True)
class LocalRate:
    tok_s: float | None = None  # mlx prefill rate on this node
    floor_s: float = 0.0  # the cost of the smallest pass (one forward step)

    def predict_s(self, n: int) -> float | None:
        return max(self.floor_s, n / self.tok_s) if self.tok_s else None


@dataclass(frozen=True)
class Ahead:
    """Prefills ahead on a node: how many, and their tokens."""

    requests: int = 0
    tokens: int = 0


@contextlib.contextmanager
def asked(in_flight: dict[str, Ahead], address: str, tokens: int) -> Iterator[None]:
    """A remote prefill of `tokens` in flight to `address`, counted in `in_flight` (by node)
    for the router while it lasts."""
    held = in_flight.get(address, Ahead())
    in_flight[address] = Ahead(held.requests + 1, held.tokens + tokens)
    try:
        yield
    finally:
        held = in_flight[address]
        left = Ahead(held.requests - 1, held.tokens - tokens)
        if left.requests:
            in_flight[address] = left
        else:
            del in_flight[address]


def predict_remote_s(
    n: int, kv_bytes: int, layers: int, peer: Peer, mine: Ahead | None = None
) -> float:
    """Seconds to a remote prefill of `n` tokens on `peer`, from asking to its last frame,
    behind what its queue holds (`mine`: what this node has in flight there)."""
    rate = peer.prefill_tok_s or OPTIMISTIC_REMOTE_TOK_S
    link = peer.link_Bps or OPTIMISTIC_LINK_BPS
    transfer = kv_bytes / link
    floor = peer.prefill_floor_s or 0.0
    queue = peer.queue
    said = Ahead(queue.waiting + (queue.running > 0), queue.tokens) if queue else Ahead()
    ahead = max(said, mine or Ahead(), key=lambda a: a.tokens)
    wait = ahead.requests * floor + ahead.tokens / rate
    return wait + DEFAULT_LATENCY_S + max(floor, n / rate, transfer) + transfer / max(layers, 1)


def choose(
    mode: Mode,
    n_tokens: int,
    kv: KVBytes,
    local: LocalRate,
    peers: list[Peer],
    in_flight: Mapping[str, Ahead] | None = None,
) -> Decision:
    """Pick local or remote prefill for `n_tokens` prompt positions, whose K/V a remote
    prefill sends as `kv` says (full layers per position, sliding ones their window at most,
    linear ones their state whatever the prompt); `in_flight`: by address, the prefills this
    node has asked of each peer and not yet had back."""
    if n_tokens < 1:
        return Decision("local", None, "nothing to prefill")
    if mode == "never":
        return Decision("local", None, "remote prefill disabled")
    if not peers:
        return Decision("local", None, "no trusted prefill node")
    if mode == "always":
        return Decision("remote", peers[0], "remote prefill forced")
    nbytes, layers, mine = kv.at(n_tokens), kv.layers, in_flight or {}

    def remote(p: Peer) -> float:
        return predict_remote_s(n_tokens, nbytes, layers, p, mine.get(p.address))

    best = min(peers, key=remote)
    remote_s = remote(best)
    local_s = local.predict_s(n_tokens)
    if local_s is None:
        return Decision("remote", best, "local rate unknown", None, remote_s)
    if remote_s < local_s:
        return Decision("remote", best, "remote predicted faster", local_s, remote_s)
    return Decision("local", None, "local predicted faster", local_s, remote_s)
