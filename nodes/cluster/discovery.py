"""mDNS: advertise this node as `_tandem._tcp.local.` and browse for the others (DESIGN.md).

Discovery finds candidates only. A node seen here goes into the PeerTable, which trusts it
after `/v1/hello` proves the token; before that a candidate gets nothing but `GET /health`
and the hello. A node that serves TLS advertises its certificate's fingerprint (TXT `cert`)
and is reached at `https://`; the fingerprint is a claim, the hello checks the real one.
Registration probes the network for ~1.6 s, so it runs in a kept task and never delays
start-up. Zeroconf's interfaces follow the bind address: a loopback node multicasts on
loopback only (other machines could not reach it anyway), a wildcard node on every interface
over IPv4 and IPv6.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Coroutine
from typing import Any

import aiohttp
import ifaddr  # zeroconf's own interface lister, one of its dependencies
from tandem.nodes.cluster.mdns_records import (
    Address,
    Advert,
    Sighting,
    address_rank,
    read_service,
    url_for,
    usable_address,
)
from tandem.nodes.cluster.peers import PeerTable
from tandem.nodes.contract.http import SERVICE_TYPE
from tandem.nodes.trust.auth import is_loopback
from tandem.nodes.trust.tls import aiohttp_pin
from zeroconf import Error as ZeroconfError
from zeroconf import (
    InterfaceChoice,
    InterfacesType,
    IPVersion,
    NonUniqueNameException,
    ServiceStateChange,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

__all__ = [  # the records are read from here too (the node, the TUI's browser)
    "Advert", "Discovery", "Sighting", "advertised_addresses", "read_service", "url_for",
    "zeroconf_interfaces",
]  # fmt: skip

log = logging.getLogger(__name__)
HINT_AFTER_S = 10.0  # no other node by then: tell the user about --peer
RESOLVE_TIMEOUT_MS = 3000
PROBE_TIMEOUT_S = 1.5
PROBE_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # a loopback-only node may still be starting
ANY_HOSTS = {"": (4, 6), "0.0.0.0": (4,), "::": (6,)}  # asyncio binds "::" IPv6-only
MAX_FOUND = 64  # mDNS is unauthenticated: bound what a flood of fake records can add
# zeroconf raises RuntimeError for an IPv6 address it finds on no interface
ZEROCONF_SETUP_ERRORS = (OSError, RuntimeError, ValueError)


def advertised_addresses(host: str) -> list[str]:
    """The addresses peers can reach a node bound to `host` at."""
    if host in ANY_HOSTS:
        families = ANY_HOSTS[host]
        found: list[Address] = []
        for adapter in ifaddr.get_adapters():
            for a in adapter.ips:
                ip = ipaddress.ip_address(a.ip if isinstance(a.ip, str) else a.ip[0])
                if ip.version in families and usable_address(ip) and ip not in found:
                    found.append(ip)
        return [str(ip) for ip in sorted(found, key=address_rank)]
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


def zeroconf_interfaces(host: str) -> tuple[InterfacesType, IPVersion | None]:
    """Where to multicast: loopback for a loopback node, everywhere for a wildcard one."""
    if is_loopback(host):
        return ["127.0.0.1"], IPVersion.V4Only  # zeroconf cannot listen on ::1
    if host in ANY_HOSTS:
        return InterfaceChoice.All, IPVersion.All
    return advertised_addresses(host), None  # zeroconf picks the version from the list


def _open_zeroconf(host: str) -> AsyncZeroconf:
    """Zeroconf on the interfaces `host` implies, else on every IPv4 interface."""
    interfaces, version = zeroconf_interfaces(host)
    try:
        return AsyncZeroconf(interfaces=interfaces, ip_version=version)
    except ZEROCONF_SETUP_ERRORS as e:
        if is_loopback(host):
            raise  # never widen a loopback node onto the LAN
        # e.g. no IPv6 here, or a --host that is not one of this machine's addresses
        log.info("mDNS: cannot multicast on %s (%s); trying all IPv4 interfaces", host, e)
        return AsyncZeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)


class Discovery:
    """Advertises one node and feeds the nodes it sees into a PeerTable."""

    def __init__(
        self,
        advert: Advert,
        peers: PeerTable,
        session: aiohttp.ClientSession,
        hint_after_s: float = HINT_AFTER_S,
    ) -> None:
        self.advert = advert
        self.peers = peers
        self.service_name = advert.instance_name()
        self.seen: dict[str, Sighting] = {}  # service name → latest records
        self._session = session
        self._hint_after_s = hint_after_s
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._addresses: dict[str, str] = {}  # service name → its address in the PeerTable
        self._resolving: dict[str, asyncio.Task[None]] = {}  # the newest per service
        self._tasks: set[asyncio.Task[None]] = set()
        self._saw_other = False

    async def start(self) -> None:
        """Start browsing now; advertise in the background. Never raises for a network."""
        try:
            addresses = advertised_addresses(self.advert.host)
            self._zc = _open_zeroconf(self.advert.host)
        except ZEROCONF_SETUP_ERRORS as e:
            log.warning("mDNS is off (%s): add other nodes with --peer https://HOST:PORT", e)
            return
        self._browser = AsyncServiceBrowser(
            self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change]
        )
        self._spawn(self._register(addresses), "mdns-register")
        if self._hint_after_s > 0:
            self._spawn(self._hint(), "mdns-hint")

    async def stop(self) -> None:
        """Stop browsing, cancel and await every task, then say goodbye and close zeroconf."""
        try:
            if self._browser is not None:
                await self._browser.async_cancel()  # no new resolve tasks after this
                self._browser = None
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if self._zc is not None:
                await self._zc.async_close()  # sends the goodbye for our registration
                self._zc = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("mDNS: %s failed", task.get_name(), exc_info=task.exception())

    async def _register(self, addresses: list[str]) -> None:
        assert self._zc is not None
        a = self.advert
        if not addresses:
            log.warning("mDNS: %s has no address peers can use; they need --peer", a.host)
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            self.service_name,
            port=a.port,
            properties=a.properties(),
            server=f"tandem-{a.id}.local.",
            parsed_addresses=addresses,
        )
        try:
            try:
                await (await self._zc.async_register_service(info))
            except NonUniqueNameException:
                log.warning(
                    "mDNS: %s is already advertised (another node with this id: "
                    "a copied config dir?); advertising under a new name",
                    info.name,
                )
                await (await self._zc.async_register_service(info, allow_name_change=True))
        except (ZeroconfError, OSError) as e:
            log.warning("mDNS: cannot advertise this node (%r); peers need --peer", e)
            return
        self.service_name = info.name
        log.info("mDNS: advertising %s at %s", info.name, ", ".join(info.parsed_addresses()))

    async def _hint(self) -> None:
        await asyncio.sleep(self._hint_after_s)
        if self._saw_other or self.peers.peers:
            return
        if is_loopback(self.advert.host):
            log.info(
                "mDNS: no other tandem node found on this machine in %.0f s. This node listens "
                "on %s only; to join other machines use --host 0.0.0.0 with a token "
                "(tandem pair), or reach them with --peer https://HOST:PORT",
                self._hint_after_s,
                self.advert.host,
            )
        else:
            log.info(
                "mDNS: no other tandem node found on the LAN in %.0f s. If other nodes are "
                "running, multicast (UDP 5353) is probably blocked (firewall, separate subnets "
                "or VLANs, Wi-Fi client isolation): connect them with --peer https://HOST:PORT",
                self._hint_after_s,
            )

    def _on_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        """Browser callback (in the event loop): the newest state of a service wins."""
        old = self._resolving.pop(name, None)
        if old is not None:
            old.cancel()
        if state_change is ServiceStateChange.Removed:
            self._forget(name)
        else:
            self._resolving[name] = self._spawn(self._resolve(name), f"mdns-resolve {name}")

    async def _resolve(self, name: str) -> None:
        assert self._zc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS):
            log.debug("mDNS: %s did not resolve", name)
            return
        sighting = read_service(info)
        if sighting is None:
            log.debug("mDNS: %s is not a tandem node (no id or port)", name)
            return
        if sighting.id == self.advert.id:
            return  # our own record: we browse the type we advertise
        self._saw_other = True
        if name not in self.seen and len(self.seen) >= MAX_FOUND:
            log.warning("mDNS: more than %d nodes advertised; ignoring %s", MAX_FOUND, name)
            return
        self.seen[name] = sighting
        url = await self._choose(sighting)
        if url is None:
            log.debug("mDNS: %s answers at none of %s", name, sighting.urls)
            return
        previous = self._addresses.get(name)
        if previous != url:
            log.info("mDNS: found %s (%s) at %s", sighting.name, sighting.id, url)
            if previous is not None:
                self.peers.lost(previous)
        self._addresses[name] = url
        self.peers.found(sighting.peer(url))

    def _forget(self, name: str) -> None:
        self.seen.pop(name, None)
        url = self._addresses.pop(name, None)
        if url is not None:
            log.info("mDNS: %s left", name)
            self.peers.lost(url)

    async def _choose(self, s: Sighting) -> str | None:
        """The best advertised address where this node answers `/health` with its own id.

        A loopback address is used only when it answers so (it may be another machine's
        loopback); a LAN address that does not answer yet is kept, and the health loop
        shows it unreachable until it does.
        """
        urls = s.urls
        for delay in (0.0, *PROBE_DELAYS_S):
            await asyncio.sleep(delay)
            answers = await asyncio.gather(*(self._answers_as(url, s) for url in urls))
            for url, ok in zip(urls, answers, strict=True):
                if ok:
                    return url
            lan = [url for url, a in zip(urls, s.addresses, strict=True) if not is_loopback(a)]
            if lan:
                return lan[0]
        return None

    async def _answers_as(self, url: str, s: Sighting) -> bool:
        """Whether `url` answers `/health` as the sighted node (and with the certificate it
        claims: an address that presents another one is not where that node is)."""
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        ssl = aiohttp_pin(s.cert_fingerprint) if s.cert_fingerprint else True
        try:
            async with self._session.get(f"{url}/health", timeout=timeout, ssl=ssl) as r:
                body = await r.json()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return False
        return isinstance(body, dict) and body.get("id") == s.id
