"""mDNS discovery in process: names, addresses, records, and the peer table against forgeries."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tandem.nodes.cluster.discovery import Discovery, advertised_addresses, zeroconf_interfaces
from tandem.nodes.cluster.mdns_records import Advert, read_service, url_for
from tandem.nodes.cluster.peers import PeerTable
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.contract.http import SERVICE_TYPE
from tandem.nodes.serve.node import NODE, NodeConfig, create_app
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo

from tests import fake_peer_support
from tests.fake_peer_support import TOKEN, FakeNode, serving
from tests.nodeproc import free_port

model = fake_peer_support.model  # this module's tiny model and its fingerprint (fixtures)
fp = fake_peer_support.fp

# -- in-process ------------------------------------------------------------------------------


def _advert(name: str = "box", node_id: str = "0123456789abcdef", port: int = 8470) -> Advert:
    return Advert(node_id, name, ("prefill",), 1, "ab" * 32, "cpu", 1 << 30, "127.0.0.1", port)


def test_instance_names_differ_per_id_and_stay_valid() -> None:
    a, b = _advert("gpu.lan"), _advert("gpu.lan", "fedcba9876543210")
    assert a.instance_name() != b.instance_name()
    assert a.instance_name() == f"gpu-lan-01234567.{SERVICE_TYPE}"
    long = _advert("é" * 80)
    label = long.instance_name().removesuffix(f".{SERVICE_TYPE}")
    assert len(label.encode()) <= 63 and label.endswith("-01234567")
    AsyncServiceInfo(SERVICE_TYPE, long.instance_name(), port=1)  # raises on a bad name
    assert _advert().properties() == {
        "id": "0123456789abcdef",
        "name": "box",
        "roles": "prefill",
        "proto": "1",
        "model": "ab" * 8,
        "device": "cpu",
        "mem": str(1 << 30),
    }


def test_urls_addresses_and_interfaces_follow_the_bind_host() -> None:
    assert url_for("10.0.0.2", 8470) == "http://10.0.0.2:8470"
    assert url_for("fd00::2", 8470) == "http://[fd00::2]:8470"
    assert advertised_addresses("127.0.0.1") == ["127.0.0.1"]
    assert advertised_addresses("fd00::2") == ["fd00::2"]
    assert "127.0.0.1" in advertised_addresses("localhost")
    v4 = advertised_addresses("0.0.0.0")
    assert v4[0] == "127.0.0.1" and all(":" not in a for a in v4)
    assert all(":" in a and not a.startswith("fe80") for a in advertised_addresses("::"))
    assert zeroconf_interfaces("127.0.0.1") == (["127.0.0.1"], IPVersion.V4Only)
    assert zeroconf_interfaces("0.0.0.0")[1] is IPVersion.All
    assert zeroconf_interfaces("fd00::2") == (["fd00::2"], None)


def test_read_service_ranks_addresses_and_rejects_foreign_records() -> None:
    info = AsyncServiceInfo(
        SERVICE_TYPE,
        f"x.{SERVICE_TYPE}",
        port=9000,
        properties={"id": "n1", "name": "x", "roles": "prefill,decode", "proto": "1", "mem": "5"},
        parsed_addresses=["fd00::7", "fe80::1", "192.168.1.7", "127.0.0.1"],
    )
    s = read_service(info)
    assert s is not None
    assert s.urls == ("http://127.0.0.1:9000", "http://192.168.1.7:9000", "http://[fd00::7]:9000")
    assert s.roles == ("prefill", "decode") and s.proto == 1 and s.mem_bytes == 5
    assert s.peer(s.urls[0]).source == "mdns"
    nameless = AsyncServiceInfo(SERVICE_TYPE, f"y.{SERVICE_TYPE}", port=1, properties={"name": "y"})
    assert read_service(nameless) is None
    garbled = AsyncServiceInfo(
        SERVICE_TYPE, f"z.{SERVICE_TYPE}", port=1, properties={"id": "z", "mem": "?"}
    )
    assert read_service(garbled) is None


def test_peer_table_keeps_static_peers_over_mdns() -> None:
    table = PeerTable("me", "fp", None)
    table.add("http://10.0.0.5:8470")
    table.peers["http://10.0.0.5:8470"] = Peer("http://10.0.0.5:8470", id="gpu")
    table.found(Peer("http://[fd00::5]:8470", id="gpu"))  # unproven: "gpu" is only a claim
    assert "http://[fd00::5]:8470" in table.peers
    del table.peers["http://[fd00::5]:8470"]
    proven = Peer("http://10.0.0.5:8470", id="gpu", trusted=True, reason=None)
    table.peers["http://10.0.0.5:8470"] = proven
    table.found(Peer("http://[fd00::5]:8470", id="gpu"))  # the same node, another address
    table.found(Peer("http://10.0.0.5:8470", id="gpu"))
    assert list(table.peers) == ["http://10.0.0.5:8470"]
    assert table.peers["http://10.0.0.5:8470"].source == "static"
    table.lost("http://10.0.0.5:8470")  # a goodbye never drops a --peer
    assert "http://10.0.0.5:8470" in table.peers

    table.found(Peer("http://10.0.0.6:8470", id="mac", trusted=True, reason=None))
    table.found(Peer("http://10.0.0.6:8470", id="mac"))  # re-announced: trust state stays
    assert table.peers["http://10.0.0.6:8470"].trusted
    assert table.peers["http://10.0.0.6:8470"].source == "mdns"
    table.found(Peer("http://10.0.0.7:8470", id="box"))
    table.lost("http://10.0.0.7:8470")  # an untrusted peer's goodbye drops it at once
    assert "http://10.0.0.7:8470" not in table.peers


async def test_the_health_loop_stops_even_when_woken_as_it_is_stopped() -> None:
    table = PeerTable("me", "fp", None)
    async with aiohttp.ClientSession() as s:
        await table.start(s)
        await asyncio.sleep(0.05)  # waiting for its next round
        table.found(Peer("http://127.0.0.1:9", id="x"))  # wakes it...
        await asyncio.wait_for(table.stop(), 5)  # ...in the same turn as the cancel


@asynccontextmanager
async def health_checked(table: PeerTable) -> AsyncIterator[None]:
    """`table` with its health loop running (on a session of its own)."""
    async with aiohttp.ClientSession() as s:
        await table.start(s)
        try:
            yield
        finally:
            await table.stop()


async def test_a_forged_record_or_goodbye_does_not_unseat_a_trusted_peer(fp: str) -> None:
    # anyone on the LAN can send mDNS: a record naming another id at a trusted peer's
    # address, or a goodbye for it, has it checked again, and it stays while it proves
    fake = FakeNode("real", "honest", fp)
    table = PeerTable("me", fp, TOKEN)
    async with serving(fake.app()) as port, health_checked(table):
        url = url_for("127.0.0.1", port)
        table.found(Peer(url, id=fake.id))
        assert (await table.check(url)).trusted  # type: ignore[union-attr]
        hellos = fake.paths.count("/v1/hello")

        table.found(Peer(url, id="bogus"))
        assert table.peers[url].id == fake.id and table.peers[url].trusted
        table.lost(url)
        assert table.peers[url].trusted  # kept until its check
        after = await table.check(url)
        assert after is not None and after.trusted and after.id == fake.id
        assert url in table.peers and fake.paths.count("/v1/hello") > hellos
    # the goodbye was true: the peer no longer answers, and goes at its next check
    table.lost(url)
    async with health_checked(table):
        await table.check(url)
        assert url not in table.peers


async def test_a_record_first_naming_the_wrong_id_still_finds_who_proves_there(fp: str) -> None:
    # a forged record seen before the real one: what answers at the address and proves the
    # token is trusted under the id it proved
    fake = FakeNode("real", "honest", fp)
    table = PeerTable("me", fp, TOKEN)
    async with serving(fake.app()) as port, health_checked(table):
        url = url_for("127.0.0.1", port)
        table.found(Peer(url, id="bogus"))
        checked = await table.check(url)
        assert checked is not None and checked.trusted and checked.id == fake.id


async def test_a_static_address_claiming_a_trusted_peers_id_does_not_unseat_it(fp: str) -> None:
    # a --peer address someone else answers (its node down) with a copy of a trusted mDNS
    # peer's /health: an id is a claim until proven, so the peer stays, records and all
    real = FakeNode("real", "honest", fp)
    claim = FakeNode("real", "wrong_proof", fp)  # the same /health id; it cannot prove
    table = PeerTable("me", fp, TOKEN)
    async with serving(real.app()) as rp, serving(claim.app()) as cp, health_checked(table):
        real_url, claim_url = url_for("127.0.0.1", rp), url_for("127.0.0.1", cp)
        table.found(Peer(real_url, id=real.id))
        assert (await table.check(real_url)).trusted  # type: ignore[union-attr]
        table.add(claim_url)
        checked = await table.check(claim_url)
        assert checked is not None and checked.id == real.id and not checked.trusted
        table.found(Peer(real_url, id=real.id))  # re-announced
        assert [p.address for p in table.trusted("prefill")] == [real_url]


async def test_hint_suggests_peer_when_nothing_is_found(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tandem.nodes.cluster.discovery")
    table = PeerTable("me", "fp", None)
    async with aiohttp.ClientSession() as s:
        lan = Discovery(replace(_advert(), host="0.0.0.0"), table, s, hint_after_s=0.01)
        await lan._hint()
        assert "--peer https://HOST:PORT" in caplog.text and "multicast" in caplog.text
        caplog.clear()
        table.add("http://10.0.0.5:8470")
        await lan._hint()
        assert "--peer" not in caplog.text


async def test_node_runs_discovery_unless_no_mdns_and_stops_it_cleanly(model: Path) -> None:
    for mdns in (False, True):
        config = NodeConfig(model=model, roles=("prefill",), port=free_port(), mdns=mdns)
        app = create_app(config)
        async with TestClient(TestServer(app)) as client:
            node = app[NODE]
            assert (node.discovery is not None) is mdns
            assert (await client.get("/health")).status == 200
        names = [t.get_name() for t in asyncio.all_tasks()]
        assert not [n for n in names if n.startswith("mdns-")], names
