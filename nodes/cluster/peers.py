"""Known peers: health-checked every 2 s, trusted only after a hello proves the token.

A peer is *trusted* when its hello v2 proof verifies on the channel this node sees
(`trust/hello.py`) and its model fingerprint equals ours. Trust is per connection identity: the
peer's id, its process (`/health` "instance"), its protocol and model, and its certificate,
pinned from the hello on. A failed health check, a restart, another certificate or another
process at the address untrusts it at once, and it proves again before any request goes to
it. Over plain HTTP (loopback) nothing pins the channel, so every health check runs the hello
again. The token itself never leaves this node: requests to a peer are signed for it
(`signed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from tandem.nodes.contract.cluster import Health, Peer, model_label
from tandem.nodes.contract.http import PROTO, Reason
from tandem.nodes.trust.hello import HelloError, Post, hello_over, prove
from tandem.nodes.trust.signing import Query, sign
from tandem.nodes.trust.tls import aiohttp_pin

log = logging.getLogger(__name__)
HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 2.0
# a trusted peer that answers its health check late this many times in a row is unreachable
# (a CPU prefill can hold a busy node's loop past one timeout); one refused connection is
SLOW_MISSES = 2


class UntrustedPeer(LookupError):
    """A request meant for a peer this node does not trust (now)."""


@dataclass(frozen=True)
class Signed:
    """What one request to a trusted peer carries: its signature headers (none without a
    token) and the certificate to pin (`None` on plain HTTP)."""

    headers: dict[str, str]
    pin: str | None


class PeerTable:
    """The peers this node knows, keyed by address; a background task keeps them fresh."""

    def __init__(
        self, own_id: str, fingerprint: str, token: str | None, proto: int = PROTO, model: str = ""
    ) -> None:
        self.own_id, self.fingerprint, self.token, self.proto = own_id, fingerprint, token, proto
        self.model = model  # this node's model as a mismatch names it (`model_label`)
        self._watchers: dict[str, set[asyncio.Event]] = {}  # see until_untrusted
        self._listeners: set[asyncio.Event] = set()  # see on_change
        self.peers: dict[str, Peer] = _Watched(self._changed)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # check now rather than at the next 2 s tick
        self._gone: set[str] = set()  # trusted mDNS peers whose records said goodbye
        self._late: dict[str, int] = {}  # trusted peers' health checks timed out in a row
        self._refused: dict[str, str] = {}  # why each address's last hello failed (said once)

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
        self._gone.discard(address.rstrip("/"))

    def found(self, peer: Peer) -> None:
        """Add a node found by mDNS and check it now; a static entry proven to be the same
        node wins (an unproven one's id is only what its address claims).

        A record is anyone's claim: it never replaces a trusted peer (what answers there and
        proves the token says who is there), so a record naming another id at its address
        only has it checked again."""
        if any(_proven_static(p, peer.id) for p in self.peers.values()):
            return
        old = self.peers.get(peer.address)
        if old is None or (old.source == "mdns" and old.id != peer.id and not old.trusted):
            self.peers[peer.address] = replace(peer, source="mdns")
        self._gone.discard(peer.address)
        self._wake.set()

    def lost(self, address: str) -> None:
        """Forget a node found by mDNS once it said goodbye; static peers stay. A trusted
        peer's goodbye (anyone can send one) is checked first: the peer goes once it no
        longer answers and proves, or once it is trusted at another address."""
        peer = self.peers.get(address)
        if peer is None or peer.source != "mdns":
            return
        if peer.trusted:
            self._gone.add(address)
            self._wake.set()
        else:
            del self.peers[address]

    @contextlib.contextmanager
    def until_untrusted(self, address: str) -> Iterator[asyncio.Event]:
        """An event set the moment the peer at `address` is not trusted (at once if it is
        not now): whatever is sent to it waits on this beside its work, and gives up."""
        event = asyncio.Event()
        self._watchers.setdefault(address, set()).add(event)
        self._changed(address)
        try:
            yield event
        finally:
            watchers = self._watchers.get(address, set())
            watchers.discard(event)
            if not watchers:
                self._watchers.pop(address, None)

    @contextlib.contextmanager
    def on_change(self) -> Iterator[asyncio.Event]:
        """An event set whenever an entry changes or goes (its holder clears it): a loop
        that acts on the table waits on it rather than polling."""
        event = asyncio.Event()
        self._listeners.add(event)
        try:
            yield event
        finally:
            self._listeners.discard(event)

    def _changed(self, address: str) -> None:
        """The entry at `address` changed (or went): tell those waiting on its trust."""
        for listener in self._listeners:
            listener.set()
        peer = self.peers.get(address)
        if peer is None or not peer.trusted:
            for event in self._watchers.get(address, ()):
                event.set()

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
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns, swallowing a cancel,
            # when the wake comes in the same turn as the cancel (stop() then never returns)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEALTH_INTERVAL_S):
                    await self._wake.wait()

    def signed(
        self, address: str, method: str, path: str, body: bytes, query: Query = None
    ) -> Signed:
        """Headers and pin for one request to the trusted peer at `address`, signed for the
        id it proved; UntrustedPeer when it is not trusted right now."""
        peer = self.peers.get(address.rstrip("/"))
        if peer is None or not peer.trusted or not peer.id:
            reason = peer.reason if peer is not None else "not a known peer"
            raise UntrustedPeer(f"{address} is not trusted ({reason})")
        tls = peer.address.startswith("https://")
        if tls and not peer.cert_fingerprint:
            raise UntrustedPeer(f"{address} has no pinned certificate")
        headers = (
            sign(self.token, method, path, query, body, self.own_id, peer.id) if self.token else {}
        )
        return Signed(headers, peer.cert_fingerprint if tls else None)

    def prover(self, address: str) -> Callable[[Post, str], Awaitable[None]] | None:
        """For a plain-HTTP peer, the hello to run on a request's own connection before the
        request goes out on it (None over TLS, where the pinned certificate is the channel's
        identity): between health checks another process may have taken the peer's port, and
        only the process that proves the token on that very connection gets the request. A
        failed proof untrusts the peer at once; UntrustedPeer."""
        if address.startswith("https://"):
            return None

        async def on_connection(post: Post, channel: str) -> None:
            try:
                proven = await hello_over(post, self.token, self.own_id, "", channel)
                peer = self.peers.get(address)
                if peer is None or proven.id != peer.id or proven.fingerprint != self.fingerprint:
                    raise HelloError("unauthorized", f"it proved to be {proven.id}, not the peer")
            except HelloError as e:
                self._untrust(address, e.reason, str(e))
                raise UntrustedPeer(f"{address} did not prove itself here: {e}") from None

        return on_connection

    def _untrust(self, address: str, reason: Reason, why: str) -> None:
        peer = self.peers.get(address)
        if peer is not None and peer.trusted:
            log.warning("peer %s not trusted: %s", address, why)
            self.peers[address] = replace(peer, trusted=False, reason=reason)
            self._wake.set()  # check it now: it proves again before anything else is sent

    async def check(self, address: str) -> Peer | None:
        """Health-check one peer; prove it again whenever what it was trusted for changed
        (at once untrusted until then), and at every check over plain HTTP."""
        assert self._session is not None
        peer = self.peers.get(address)
        if peer is None:
            return None
        pinned = peer.trusted and address.startswith("https://") and bool(peer.cert_fingerprint)
        try:
            health = await self._health(address, peer.cert_fingerprint if pinned else None)
        except aiohttp.ServerFingerprintMismatch:
            log.warning("peer %s presents another certificate: untrusted", address)
            updated = replace(peer, trusted=False, reason="unauthorized")
        except TimeoutError as e:
            self._late[address] = late = self._late.get(address, 0) + 1
            if peer.trusted and late < SLOW_MISSES:
                log.info("peer %s answered its health check late (%d in a row)", address, late)
                self._wake.set()  # ask again at once rather than in HEALTH_INTERVAL_S
                return peer
            updated = self._unreachable(peer, e)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            updated = self._unreachable(peer, e)
        else:
            self._late.pop(address, None)
            updated = await self._checked(peer, health)
        current = self.peers.get(address)
        if current is not None:  # rates measured while this check ran are kept
            self.peers[address] = replace(
                updated, prefill_tok_s=current.prefill_tok_s, link_Bps=current.link_Bps,
                prefill_floor_s=current.prefill_floor_s,
            )  # fmt: skip
            updated = self.peers[address]
        if _proven_static(updated, updated.id):
            for a, p in list(self.peers.items()):  # the same node, also found by mDNS
                if p.source == "mdns" and p.id == updated.id:
                    del self.peers[a]
        if address in self._gone and current is not None:
            elsewhere = any(
                a != address and p.trusted and p.id == updated.id for a, p in self.peers.items()
            )
            if not updated.trusted or elsewhere:
                self._gone.discard(address)
                self.peers.pop(address, None)
        return updated

    def _unreachable(self, peer: Peer, e: BaseException) -> Peer:
        if peer.reason != "unreachable":
            log.warning("peer %s unreachable: %s%s", peer.address, e, _scheme_hint(peer.address))
        return replace(peer, trusted=False, reason="unreachable")

    async def _health(self, address: str, pin: str | None) -> Health:
        # unpinned: /health is public and the hello checks the certificate (http ignores ssl=)
        ssl: aiohttp.Fingerprint | bool = aiohttp_pin(pin) if pin else False
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        assert self._session is not None
        async with self._session.get(f"{address}/health", timeout=timeout, ssl=ssl) as r:
            return Health.from_json(await r.json())

    async def _checked(self, peer: Peer, health: Health) -> Peer:
        """The peer after a health check that answered `health`."""
        updated = replace(
            peer,
            id=health.id,
            name=health.name,
            roles=health.roles,
            device=health.device,
            mem_bytes=health.mem_bytes,
            budget_bytes=health.budget_bytes,
            model={
                "name": health.model_name,
                "fingerprint": health.fingerprint,
                "revision": health.model_revision,
            },
            proto=health.proto,
            instance=health.instance,
            group=health.group,
            queue=health.queue,
            last_seen=time.time(),
        )
        tls = peer.address.startswith("https://")
        same = peer.trusted and _identity(peer) == _identity(updated)
        if same and tls and health.cert_fingerprint == peer.cert_fingerprint:
            return replace(updated, reason=None)  # the pinned channel says the rest
        if peer.trusted and not same and peer.address in self.peers:
            log.info("peer %s changed (restart or another process): proving again", peer.address)
            # untrusted while the hello runs: nothing is sent to it until it proved again
            self.peers[peer.address] = replace(peer, trusted=False, reason="unauthorized")
        return await self._hello(updated)

    async def _hello(self, peer: Peer) -> Peer:
        assert self._session is not None
        if peer.proto != self.proto:
            return replace(peer, trusted=False, reason="protocol_mismatch")
        try:
            proven = await prove(self._session, peer.address, self.token, self.own_id)
        except HelloError as e:
            # each new refusal is said once, whatever untrusted the peer before (a changed
            # certificate, an unreachable spell)
            if peer.trusted or self._refused.get(peer.address) != str(e):
                self._refused[peer.address] = str(e)
                log.warning("peer %s not trusted: %s", peer.address, e)
            return replace(peer, trusted=False, reason=e.reason)
        said = self._refused.pop(peer.address, None)
        if proven.id != peer.id:
            log.warning("peer %s proved id %s, not %s: untrusted", peer.address, proven.id, peer.id)
            return replace(peer, trusted=False, reason="unauthorized")
        if proven.fingerprint != self.fingerprint:
            self._mismatch(peer, proven.fingerprint, said)
            return replace(peer, trusted=False, reason="model_mismatch")
        if not peer.trusted:
            log.info("peer %s (%s) trusted", peer.address, peer.name or proven.id)
        return replace(peer, cert_fingerprint=proven.cert_fingerprint, trusted=True, reason=None)

    def _mismatch(self, peer: Peer, theirs: str, said: str | None) -> None:
        """Say once (unless not what was `said`) that `peer` serves another model."""
        model = model_label(peer.model.get("name", "?"), peer.model.get("revision", ""))
        why = (
            f"serves another model: {model} (fingerprint {theirs[:12]}), here "
            f"{self.model or 'this model'} (fingerprint {self.fingerprint[:12]})"
        )
        self._refused[peer.address] = why
        if said != why:
            log.warning("peer %s not trusted: %s", peer.address, why)


class _Watched(dict[str, Peer]):
    """The table's entries: each change (set, setdefault, delete, pop) is told to `changed`,
    so a peer that loses trust anywhere in the table wakes its waiters (`until_untrusted`)."""

    def __init__(self, changed: Callable[[str], None]) -> None:
        super().__init__()
        self._on_change = changed

    def __setitem__(self, address: str, peer: Peer) -> None:
        super().__setitem__(address, peer)
        self._on_change(address)

    def __delitem__(self, address: str) -> None:
        super().__delitem__(address)
        self._on_change(address)

    def setdefault(self, address: str, peer: Peer) -> Peer:  # type: ignore[override]
        if address in self:
            return self[address]
        self[address] = peer
        return peer

    def pop(self, address: str, *default: Any) -> Any:  # type: ignore[override]
        out = super().pop(address, *default)
        self._on_change(address)
        return out


def _proven_static(peer: Peer, node_id: str) -> bool:
    """Whether `peer` is a `--peer` entry that proved to be the node `node_id`."""
    return peer.source == "static" and peer.trusted and bool(node_id) and peer.id == node_id


def _identity(peer: Peer) -> tuple[str, str, int, str]:
    """What trust was granted for: a change (a restart, another model) proves again."""
    return peer.id, peer.instance, peer.proto, peer.model.get("fingerprint", "")


def _scheme_hint(address: str) -> str:
    if address.startswith("http://") and not address.startswith(("http://127.", "http://[::1]")):
        return " (a node listening beyond loopback speaks https://)"
    return ""


def _ewma(old: float | None, new: float | None, weight: float = 0.3) -> float | None:
    if not new:
        return old
    return new if not old else (1 - weight) * old + weight * new
