"""Find nodes on the LAN by mDNS (`_tandem._tcp.local.`), client side only.

Discovery finds candidates; trust still comes from `/v1/hello` (DESIGN.md "mDNS"), which
the dashboard's probe does before it sends the token anywhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tandem.nodes.cluster.discovery import read_service
from tandem.nodes.contract.http import SERVICE_TYPE as SERVICE
from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)


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
                # the node's own reading of its record: best address first, `https://` for
                # a node that advertises a certificate, foreign or garbled records dropped
                sighting = read_service(info)
                if sighting is not None and sighting.urls:
                    found(sighting.urls[0])
    finally:
        await browser.async_cancel()
        await aiozc.async_close()
