"""The dashboard finds nodes by mDNS: a service announced on loopback becomes a node row."""

from __future__ import annotations

import asyncio
import secrets
import socket
from contextlib import suppress

from tandem.app.tui.app import TandemApp
from tandem.app.tui.browse import SERVICE, browse
from tandem.app.tui.messages import NodeFound
from zeroconf import ServiceInfo
from zeroconf.asyncio import AsyncZeroconf


def _service(port: int, **props: str) -> ServiceInfo:
    return ServiceInfo(
        SERVICE,
        f"tandem-test-{secrets.token_hex(4)}.{SERVICE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=port,
        properties={"id": secrets.token_hex(4), "roles": "prefill", "proto": "2", **props},
    )


async def _found_after(infos: list[ServiceInfo], want: set[str]) -> list[str]:
    """Announce `infos` on loopback; the URLs `browse` reported once it saw all of `want`."""
    zc = AsyncZeroconf(interfaces=["127.0.0.1"])
    found: list[str] = []
    task = asyncio.create_task(browse(found.append))
    try:
        for info in infos:
            await zc.async_register_service(info)
        for _ in range(100):
            if want <= set(found):
                break
            await asyncio.sleep(0.1)
        return found
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        for info in infos:
            await zc.async_unregister_service(info)
        await zc.async_close()


async def test_browse_finds_an_announced_node() -> None:
    port = 20000 + secrets.randbelow(20000)
    found = await _found_after([_service(port)], {f"http://127.0.0.1:{port}"})
    assert f"http://127.0.0.1:{port}" in found


async def test_a_node_that_advertises_a_certificate_is_reached_over_https() -> None:
    """A node listening beyond loopback serves TLS and says so in TXT `cert`: the dashboard
    must dial it at https:// (http:// would only ever see a failed handshake); a record
    whose `cert` is not a fingerprint is not a tandem node's and is dropped."""
    tls, garbled = (20000 + secrets.randbelow(20000) for _ in range(2))
    infos = [_service(tls, cert="ab" * 32), _service(garbled, cert="not-a-fingerprint")]
    found = await _found_after(infos, {f"https://127.0.0.1:{tls}"})
    assert f"https://127.0.0.1:{tls}" in found
    assert f"http://127.0.0.1:{tls}" not in found
    assert not [u for u in found if u.endswith(f":{garbled}")]


async def test_a_found_node_joins_the_nodes_panel() -> None:
    app = TandemApp([], None, mdns=False, live=False)
    async with app.run_test(size=(120, 40)) as pilot:
        app.post_message(NodeFound("http://192.168.1.5:8470"))
        await pilot.pause()
        assert app.cluster.rows["http://192.168.1.5:8470"].status == "connecting"
        assert app.query_one("#nodes").row_count == 1  # type: ignore[attr-defined]
