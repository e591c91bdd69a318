"""The dashboard finds nodes by mDNS: a service announced on loopback becomes a node row."""

from __future__ import annotations

import asyncio
import secrets
import socket
from contextlib import suppress

from zeroconf import ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from app.tui.app import TandemApp
from app.tui.browse import SERVICE, browse, service_url
from app.tui.messages import NodeFound


def test_service_url_prefers_ipv4() -> None:
    assert service_url(["fe80::1", "192.168.1.5"], 8470) == "http://192.168.1.5:8470"
    assert service_url(["::1"], 8470) == "http://[::1]:8470"
    assert service_url([], 8470) is None


async def test_browse_finds_an_announced_node() -> None:
    port = 20000 + secrets.randbelow(20000)
    info = ServiceInfo(
        SERVICE,
        f"tandem-test-{secrets.token_hex(4)}.{SERVICE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties={"id": "x", "roles": "prefill", "proto": "1"},
    )
    zc = AsyncZeroconf(interfaces=["127.0.0.1"])
    found: list[str] = []
    task = asyncio.create_task(browse(found.append))
    try:
        await zc.async_register_service(info)
        for _ in range(100):
            if f"http://127.0.0.1:{port}" in found:
                break
            await asyncio.sleep(0.1)
        assert f"http://127.0.0.1:{port}" in found
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await zc.async_unregister_service(info)
        await zc.async_close()


async def test_a_found_node_joins_the_nodes_panel() -> None:
    app = TandemApp([], None, mdns=False, live=False)
    async with app.run_test(size=(120, 40)) as pilot:
        app.post_message(NodeFound("http://192.168.1.5:8470"))
        await pilot.pause()
        assert app.cluster.rows["http://192.168.1.5:8470"].status == "connecting"
        assert app.query_one("#nodes").row_count == 1  # type: ignore[attr-defined]
