"""Issue 19: the peer table's trust per connection identity and the dashboard client's pins."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from tandem.app.tui.client import NodeClient, NodeError
from tandem.nodes.cluster.peers import PeerTable, UntrustedPeer
from tandem.nodes.contract.cluster import Cluster, Peer
from tandem.nodes.contract.http import PROTO
from tandem.nodes.trust.signing import SIGNATURE, Verifier
from tandem.nodes.trust.tls import Identity

from tests import hello_support
from tests.hello_support import CALLEE, FP, TOKEN, FakeCallee, callee
from tests.trust_support import serving

ident = hello_support.ident  # this module's TLS identities (module-scoped fixtures)
other_ident = hello_support.other_ident

# -- the peer table: trust per connection identity ------------------------------------------


def table_for(session: aiohttp.ClientSession, url: str) -> PeerTable:
    """A decode node's peer table knowing `url`, checked by hand (no background loop)."""
    table = PeerTable("decode-a", FP, TOKEN, PROTO)
    table._session = session
    table.add(url)
    return table


async def test_a_failed_health_check_untrusts_at_once(ident: Identity) -> None:
    fake = FakeCallee(identity=ident)
    async with aiohttp.ClientSession() as s:
        async with serving(fake.app(), ident) as url:
            table = table_for(s, url)
            assert (await table.check(url)).trusted  # type: ignore[union-attr]
        after = await table.check(url)  # one failed check, not a timeout later
    assert after is not None and not after.trusted and after.reason == "unreachable"


async def test_a_late_health_answer_untrusts_only_the_second_time_in_a_row(
    ident: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy node can answer one check late (its loop held by a CPU prefill): that alone
    must not cancel the requests it serves; a second late answer in a row does."""
    fake = FakeCallee(identity=ident)
    async with aiohttp.ClientSession() as s, serving(fake.app(), ident) as url:
        table = table_for(s, url)
        assert (await table.check(url)).trusted  # type: ignore[union-attr]

        async def late(address: str, pin: str | None) -> None:
            raise TimeoutError

        monkeypatch.setattr(table, "_health", late)
        assert (await table.check(url)).trusted  # type: ignore[union-attr]
        after = await table.check(url)
    assert after is not None and not after.trusted and after.reason == "unreachable"


async def test_a_restart_is_untrusted_before_the_new_hello_ends() -> None:
    """A new `instance` at the same address: untrusted at once, trusted again only after it
    proves the token; nothing may be signed for it in between."""
    async with callee() as fake, aiohttp.ClientSession() as s:
        table = table_for(s, fake.url)
        assert (await table.check(fake.url)).trusted  # type: ignore[union-attr]
        fake.instance, fake.hold = "i-2", asyncio.Event()
        check = asyncio.create_task(table.check(fake.url))
        for _ in range(100):
            if not table.peers[fake.url].trusted:
                break
            await asyncio.sleep(0.02)
        assert not table.peers[fake.url].trusted and not check.done()
        with pytest.raises(UntrustedPeer):
            table.signed(fake.url, "POST", "/v1/prefill", b"{}")
        fake.hold.set()
        again = await check
    assert again is not None and again.trusted and again.instance == "i-2"


async def test_another_certificate_at_the_address_is_refused(
    tmp_path: Path, ident: Identity, other_ident: Identity
) -> None:
    async with callee(ident) as fake, aiohttp.ClientSession() as s:
        table = table_for(s, fake.url)
        assert (await table.check(fake.url)).trusted  # type: ignore[union-attr]
        pinned = table.peers[fake.url].cert_fingerprint
        assert pinned == ident.fingerprint
        port = int(fake.url.rsplit(":", 1)[1])
        headers = table.signed(fake.url, "POST", "/v1/prefill", b"{}")
        assert headers.pin == ident.fingerprint
        assert Verifier(TOKEN, CALLEE).verify("POST", "/v1/prefill", None, b"{}", headers.headers)
    # an impostor holding no token, with its own certificate, a copy of /health and the port
    impostor = FakeCallee(token="not-the-cluster-token-000", identity=other_ident)
    async with serving(impostor.app(), other_ident, port) as url, aiohttp.ClientSession() as s:
        table = table_for(s, url)
        table.peers[url] = replace_trusted(url, pinned)  # as the table left it
        after = await table.check(url)
        assert after is not None and not after.trusted and after.reason == "unauthorized"
        assert impostor.paths() == []  # the pinned handshake failed before any request
        after = await table.check(url)  # proving again: it cannot
        assert after is not None and not after.trusted and after.reason == "unauthorized"
    assert all(SIGNATURE not in h and "Authorization" not in h for _, h in impostor.seen)
    assert "/v1/hello/confirm" not in impostor.paths()


def replace_trusted(url: str, pin: str) -> Peer:
    return Peer(
        url,
        id=CALLEE,
        roles=("prefill",),
        proto=PROTO,
        trusted=True,
        reason=None,
        model={"name": "m", "fingerprint": FP},
        instance="i-1",
        cert_fingerprint=pin,
    )


def test_signed_needs_a_trusted_peer() -> None:
    table = PeerTable("me", FP, TOKEN)
    with pytest.raises(UntrustedPeer):
        table.signed("http://127.0.0.1:1", "POST", "/v1/prefill", b"")
    table.peers["https://h:1"] = Peer("https://h:1", id="p", trusted=True, reason=None)
    with pytest.raises(UntrustedPeer, match="pinned"):  # https without a pin: never
        table.signed("https://h:1", "POST", "/v1/prefill", b"")
    open_table = PeerTable("me", FP, None)
    open_table.peers["http://h:1"] = Peer("http://h:1", id="p", trusted=True, reason=None)
    assert open_table.signed("http://h:1", "POST", "/v1/prefill", b"").headers == {}


# -- clients: the dashboard and `tandem pair` ------------------------------------------------


async def test_the_dashboard_client_pins_what_the_hello_covered(
    ident: Identity, other_ident: Identity
) -> None:
    async with aiohttp.ClientSession() as s:
        async with callee(ident) as fake:
            client = NodeClient(s, fake.url, TOKEN)
            probe = await client.probe()
            view = Cluster.from_json({"self": {"id": CALLEE}, "peers": []})  # what it answered
            assert probe.ok and probe.cluster == view
            assert client.cert_fingerprint == ident.fingerprint
            port = int(fake.url.rsplit(":", 1)[1])
        bearer_seen = [p for p, h in fake.seen if "Authorization" in h]
        assert bearer_seen == ["/v1/cluster"]  # after the hello, never before
        impostor = FakeCallee(identity=other_ident)  # even one holding the token
        async with serving(impostor.app(), other_ident, port):
            with pytest.raises(NodeError) as e:  # the pinned certificate is not this one
                await client._get_json("/v1/cluster", auth=True)
            assert e.value.reason == "unreachable"
            assert impostor.seen == []
            again = await client.probe()  # a new probe proves again, and pins anew
            assert again.ok and client.cert_fingerprint == other_ident.fingerprint
        async with callee(ident, token="wrong-token-0123456789abcdef") as liar:
            probe = await NodeClient(s, liar.url, TOKEN).probe()
            assert probe.reason == "unauthorized"
            assert not [p for p, h in liar.seen if "Authorization" in h]


async def test_the_dashboard_client_proves_a_plain_http_node_before_each_stream() -> None:
    """On plain HTTP nothing pins a node between hellos: a chat or an event stream proves the
    node at that address first, so an impostor that took the port after the probe (here one
    with another token) never receives the bearer."""
    async with aiohttp.ClientSession() as s:
        async with callee() as fake:
            client = NodeClient(s, fake.url, TOKEN)
            assert (await client.probe()).ok and client.proven
            port = int(fake.url.rsplit(":", 1)[1])
        impostor = FakeCallee(token="wrong-token-0123456789abcdef")
        async with serving(impostor.app(), None, port):
            with pytest.raises(NodeError) as e:
                async for _ in client.chat([{"role": "user", "content": "hi"}]):
                    pass
            assert e.value.reason == "unauthorized" and not client.proven
            with pytest.raises(NodeError) as e:
                async for _ in client.events():
                    pass
            assert e.value.reason == "unauthorized"
            assert impostor.paths() and not [p for p, h in impostor.seen if "Authorization" in h]
        async with serving(fake.app(), None, port):  # the real node back: proved again, used
            assert (await client.probe()).ok and client.proven


async def test_on_change_wakes_its_holder_on_any_entry_change_and_stops_after() -> None:
    """What the decode node's probe loop waits on instead of polling the table."""
    table = PeerTable("decode-a", FP, TOKEN, PROTO)
    with table.on_change() as changed:
        assert not changed.is_set()
        table.add("http://127.0.0.1:9")
        assert changed.is_set()
        changed.clear()
        table.remove("http://127.0.0.1:9")
        assert changed.is_set()
        changed.clear()
        waiter = asyncio.create_task(changed.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        table.add("http://127.0.0.1:10")
        await asyncio.wait_for(waiter, 1.0)
    changed.clear()
    table.add("http://127.0.0.1:11")  # left: nobody is told any more
    assert not changed.is_set()
