"""Find nodes on the LAN by mDNS (`_tandem._tcp.local.`), client side only.

Discovery finds candidates; trust still comes from `/v1/hello` (DESIGN.md "mDNS"), which
the dashboard's probe does before it sends the token anywhere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable

from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)
SERVICE = "_tandem._tcp.local."


def service_url(addresses: list[str], port: int) -> str | None:
    """The node's URL, IPv4 first (IPv6 in brackets)."""
    if not addresses or not port:
        return None
    ordered = sorted(addresses, key=lambda a: ipaddress.ip_address(a).version)
    host = ordered[0]
    if ipaddress.ip_address(host).version == 6:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def browse(found: Callable[[str], None]) -> None:
    """Call `found(url)` for every tandem node announced on the LAN, until cancelled."""
    aiozc = AsyncZeroconf()
    names: asyncio.Queue[str] = asyncio.Queue()

    def on_change(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            names.put_nowait(name)

    browser = AsyncServiceBrowser(aiozc.zeroconf, SERVICE, handlers=[on_change])
    try:
        while True:
            name = await names.get()
            info = AsyncServiceInfo(SERVICE, name)
            if await info.async_request(aiozc.zeroconf, 3000):
                url = service_url(info.parsed_addresses(), info.port or 0)
                if url is not None:
                    found(url)
    finally:
        await browser.async_cancel()
        await aiozc.async_close()
