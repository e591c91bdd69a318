"""Where to prefill a prompt: here with mlx, or on a trusted prefill node.

`auto` compares predicted times: local = n / local rate; remote = latency + the longer of
n / the node's prefill rate and KV bytes / link rate (layers stream while the next computes,
so compute and transfer overlap), plus one layer's worth of transfer. Rates come from past
requests and a start-up calibration; an unmeasured remote rate counts as promising (a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nodes.peers import Peer

Mode = Literal["auto", "always", "never"]
DEFAULT_LATENCY_S = 0.005
OPTIMISTIC_REMOTE_TOK_S = 5000.0
OPTIMISTIC_LINK_BPS = 1e9 / 8  # 1 Gbit/s


@dataclass(frozen=True)
class Decision:
    where: Literal["local", "remote"]
    peer: Peer | None
    reason: str
    local_s: float | None = None
    remote_s: float | None = None


def predict_remote_s(n: int, kv_bytes: int, layers: int, peer: Peer) -> float:
    rate = peer.prefill_tok_s or OPTIMISTIC_REMOTE_TOK_S
    link = peer.link_Bps or OPTIMISTIC_LINK_BPS
    transfer = kv_bytes / link
    return DEFAULT_LATENCY_S + max(n / rate, transfer) + transfer / max(layers, 1)


def choose(
    mode: Mode,
    n_tokens: int,
    kv_bytes_per_token: int,
    layers: int,
    local_tok_s: float | None,
    peers: list[Peer],
) -> Decision:
    """Pick local or remote prefill for `n_tokens` prompt positions."""
    if n_tokens < 1:
        return Decision("local", None, "nothing to prefill")
    if mode == "never":
        return Decision("local", None, "remote prefill disabled")
    if not peers:
        return Decision("local", None, "no trusted prefill node")
    if mode == "always":
        return Decision("remote", peers[0], "remote prefill forced")
    kv = n_tokens * kv_bytes_per_token
    best = min(peers, key=lambda p: predict_remote_s(n_tokens, kv, layers, p))
    remote_s = predict_remote_s(n_tokens, kv, layers, best)
    if not local_tok_s:
        return Decision("remote", best, "local rate unknown", None, remote_s)
    local_s = n_tokens / local_tok_s
    if remote_s < local_s:
        return Decision("remote", best, "remote predicted faster", local_s, remote_s)
    return Decision("local", None, "local predicted faster", local_s, remote_s)
