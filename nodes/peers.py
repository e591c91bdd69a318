"""Known peers: health-checked every 2 s, trusted only after `/v1/hello` proves the token.

A peer is *trusted* when its proof verifies and its model fingerprint equals ours. The token
is never sent to a peer before that (DESIGN.md): `/health` and `/v1/hello` carry none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import aiohttp

from nodes.auth import proof, verify_proof
from nodes.contract import Health, Reason

log = logging.getLogger(__name__)
Source = Literal["static", "mdns"]  # `--peer URL`, or found by nodes.discovery
HEALTH_INTERVAL_S = 2.0
UNREACHABLE_AFTER_S = 6.0  # well inside the 10 s DESIGN.md allows


@dataclass(frozen=True)
class Peer:
    """One node as `/v1/cluster` shows it (DESIGN.md Peer shape)."""

    address: str
    id: str = ""
    name: str = ""
    roles: tuple[str, ...] = ()
    device: str = ""
    mem_bytes: int = 0
    budget_bytes: int = 0
    model: dict[str, str] = field(default_factory=dict)
    proto: int = 0
    trusted: bool = False
    reason: Reason | None = "unreachable"
    last_seen: float = 0.0
    prefill_tok_s: float | None = None
    link_Bps: float | None = None
    prefill_floor_s: float | None = None  # the cheapest remote pass seen (weights + HTTP)
    source: Source = "static"

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "roles": list(self.roles),
            "address": self.address,
            "device": self.device,
            "mem_bytes": self.mem_bytes,
            "budget_bytes": self.budget_bytes,
            "model": dict(self.model),
            "proto": self.proto,
            "trusted": self.trusted,
            "reason": self.reason,
            "last_seen": self.last_seen,
            "prefill_tok_s": self.prefill_tok_s,
            "link_Bps": self.link_Bps,
            "prefill_floor_s": self.prefill_floor_s,
            "source": self.source,
        }


class PeerTable:
    """The peers this node knows, keyed by address; a background task keeps them fresh."""

    def __init__(self, own_id: str, fingerprint: str, token: str | None, proto: int = 1) -> None:
        self.own_id = own_id
        self.fingerprint = fingerprint
        self.token = token
        self.proto = proto
        self.peers: dict[str, Peer] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # check now rather than at the next 2 s tick

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._task = asyncio.create_task(self._loop(), name="peer-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def add(self, address: str) -> None:
        address = address.rstrip("/")
        self.peers.setdefault(address, Peer(address=address))

    def remove(self, address: str) -> None:
        self.peers.pop(address.rstrip("/"), None)

    def found(self, peer: Peer) -> None:
        """Add a node found by mDNS and check it now; a static entry for the same node wins."""
        if any(p.source == "static" and p.id == peer.id for p in self.peers.values()):
            return
        old = self.peers.get(peer.address)
        if old is None or (old.source == "mdns" and old.id != peer.id):
            self.peers[peer.address] = replace(peer, source="mdns")
        self._wake.set()

    def lost(self, address: str) -> None:
        """Forget a node found by mDNS once it said goodbye; static peers stay."""
        peer = self.peers.get(address)
        if peer is not None and peer.source == "mdns":
            del self.peers[address]

    def trusted(self, role: str) -> list[Peer]:
        return [p for p in self.peers.values() if p.trusted and role in p.roles]

    def update_rates(
        self,
        address: str,
        prefill_tok_s: float | None = None,
        link_Bps: float | None = None,
        seconds: float | None = None,
    ) -> None:
        """Fold one remote prefill's measurements in (moving averages; floor = cheapest)."""
        p = self.peers.get(address)
        if p is None:
            return
        self.peers[address] = replace(
            p,
            prefill_tok_s=_ewma(p.prefill_tok_s, prefill_tok_s),
            link_Bps=_ewma(p.link_Bps, link_Bps),
            prefill_floor_s=min(x for x in (p.prefill_floor_s, seconds, float("inf")) if x)
            if (p.prefill_floor_s or seconds)
            else None,
        )

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            await asyncio.gather(*(self.check(a) for a in list(self.peers)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), HEALTH_INTERVAL_S)

    async def check(self, address: str) -> Peer | None:
        """Health-check one peer; (re)verify its proof when it was not trusted."""
        assert self._session is not None
        peer = self.peers.get(address)
        if peer is None:
            return None
        timeout = aiohttp.ClientTimeout(total=2.0)
        try:
            async with self._session.get(f"{address}/health", timeout=timeout) as r:
                health = Health.from_json(await r.json())
            updated = replace(
                peer,
                id=health.id,
                name=health.name,
                roles=health.roles,
                device=health.device,
                mem_bytes=health.mem_bytes,
                budget_bytes=health.budget_bytes,
                model={"name": health.model_name, "fingerprint": health.fingerprint},
                proto=health.proto,
                last_seen=time.time(),
            )
            if peer.source == "mdns" and peer.id and updated.id != peer.id:
                # another process answers at the address this node advertised
                updated = replace(peer, trusted=False, reason="unreachable")
            elif not peer.trusted or _identity(peer) != _identity(updated):
                updated = await self._hello(updated)
            else:
                updated = replace(updated, reason=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            stale = time.time() - peer.last_seen > UNREACHABLE_AFTER_S
            if stale or not peer.last_seen:
                if peer.reason != "unreachable":
                    log.warning("peer %s unreachable: %s", address, e)
                updated = replace(peer, trusted=False, reason="unreachable")
            else:
                updated = peer
        if address in self.peers:
            self.peers[address] = updated
        if updated.source == "static" and updated.id:
            for a, p in list(self.peers.items()):  # the same node, also found by mDNS
                if p.source == "mdns" and p.id == updated.id:
                    del self.peers[a]
        return updated

    async def _hello(self, peer: Peer) -> Peer:
        assert self._session is not None
        if peer.proto != self.proto:
            return replace(peer, trusted=False, reason="protocol_mismatch")
        nonce = secrets.token_hex(16)
        async with self._session.post(
            f"{peer.address}/v1/hello",
            json={"nonce": nonce, "id": self.own_id},
            timeout=aiohttp.ClientTimeout(total=3.0),
        ) as r:
            if r.status != 200:
                return replace(peer, trusted=False, reason="unauthorized")
            answer = await r.json()
        peer_id = str(answer.get("id", ""))
        fp = str(answer.get("fingerprint", ""))
        ok = verify_proof(self.token or "", nonce, self.own_id, peer_id, fp, answer.get("proof"))
        if not ok:
            return replace(peer, trusted=False, reason="unauthorized")
        if fp != self.fingerprint:
            return replace(peer, trusted=False, reason="model_mismatch")
        if not peer.trusted:
            log.info("peer %s (%s) trusted", peer.address, peer.name or peer_id)
        return replace(peer, id=peer_id, trusted=True, reason=None)


def _identity(peer: Peer) -> tuple[str, int, str]:
    """What trust was granted for: a change (a restart with another model) asks again."""
    return peer.id, peer.proto, peer.model.get("fingerprint", "")


def _ewma(old: float | None, new: float | None, weight: float = 0.3) -> float | None:
    if not new:
        return old
    return new if not old else (1 - weight) * old + weight * new


def hello_answer(token: str | None, own_id: str, fingerprint: str, body: object) -> dict[str, str]:
    """This node's answer to `/v1/hello`. Raises ValueError on a malformed body."""
    if not isinstance(body, dict) or not isinstance(body.get("nonce"), str):
        raise ValueError("hello needs {nonce, id}")
    nonce, caller = body["nonce"], str(body.get("id", ""))
    if not 8 <= len(nonce) <= 256:
        raise ValueError("nonce must be 8..256 characters")
    return {
        "id": own_id,
        "fingerprint": fingerprint,
        "proof": proof(token or "", nonce, caller, own_id, fingerprint),
    }
