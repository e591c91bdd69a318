"""mDNS discovery and peer trust: real node processes on loopback, the test's own zeroconf,
and fake nodes the test controls (DESIGN.md: mDNS, `/v1/hello`, `/v1/cluster`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from tandem.nodes.cluster.discovery import Discovery, advertised_addresses, zeroconf_interfaces
from tandem.nodes.cluster.mdns_records import Advert, read_service, url_for
from tandem.nodes.cluster.peers import PeerTable
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.contract.http import PROTO, SERVICE_TYPE
from tandem.nodes.model import fingerprint, load_index
from tandem.nodes.serve.node import NODE, NodeConfig, create_app
from tandem.nodes.trust.hello import HelloResponder
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from tests.discovery_support import (
    MdnsNode,
    mutual_trust,
    peer,
    poll,
    start_mdns_node,
    trusted_by,
)
from tests.nodeproc import free_port, wait_healthy

TXT_KEYS = {"id", "name", "roles", "proto", "model", "device", "mem"}
TOKEN = "discovery-test-token-0123456789"
OTHER_FP = "0" * 64
Behaviour = Literal["honest", "wrong_proof", "other_model", "old_proto"]


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def fp(model: Path) -> str:
    return fingerprint(load_index(model))


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, model: Path
) -> Iterator[tuple[MdnsNode, MdnsNode, float]]:
    """A prefill and a decode node, mDNS on, no --peer, one --name: (prefill, decode, t_up)."""
    tmp = tmp_path_factory.mktemp("pair")
    nodes: list[MdnsNode] = []
    try:
        for role in ("prefill", "decode"):
            nodes.append(start_mdns_node(tmp, model, role, "--name", "twin", wait=False))
        for node in nodes:
            wait_healthy(node)
        yield nodes[0], nodes[1], time.monotonic()
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[MdnsNode]:
    """A decode node with a token that always wants a remote prefill."""
    tmp = tmp_path_factory.mktemp("guarded")
    node = start_mdns_node(tmp, model, "decode", "--remote-prefill", "always", token=TOKEN)
    try:
        yield node
    finally:
        node.stop()


class FakeNode:
    """A node the test controls: answers `/health` and `/v1/hello` as `behaviour` says and
    records every request it gets, headers included."""

    def __init__(self, name: str, behaviour: Behaviour, fp: str) -> None:
        self.name = name
        self.id = f"fake-{name}"
        self.behaviour = behaviour
        self.fp = fp
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, headers)

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def model_fp(self) -> str:
        return OTHER_FP if self.behaviour == "other_model" else self.fp

    def app(self) -> web.Application:
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append((request.path, dict(request.headers)))
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/hello", self.hello)
        app.router.add_post("/v1/hello/confirm", self.confirm)
        app.router.add_route("*", "/{tail:.*}", self.refuse)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "id": self.id,
                "name": self.name,
                "roles": ["prefill"],
                "proto": PROTO + 1 if self.behaviour == "old_proto" else PROTO,
                "device": "cuda",
                "mem_bytes": 1 << 30,
                "budget_bytes": 1 << 28,
                "model": {"name": "m", "fingerprint": self.model_fp(), "layers": 4},
            }
        )

    async def hello(self, request: web.Request) -> web.Response:
        if getattr(self, "responder", None) is None or self.responder.fingerprint != (
            self.model_fp()
        ):  # one responder per model: concurrent hellos' cookies stay good at their confirms
            self.responder = HelloResponder(TOKEN, self.id, self.model_fp(), "")
        sockname = request.transport.get_extra_info("sockname")  # type: ignore[union-attr]
        answer = self.responder.answer(await request.json(), sockname)
        if self.behaviour == "wrong_proof":
            answer["proof"] = "ab" * 32
        return web.json_response(answer)

    async def confirm(self, request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname")  # type: ignore[union-attr]
        caller = self.responder.confirm(await request.json(), sockname)
        return web.json_response({"caller": caller})

    async def refuse(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "fake"}}, status=500)

    def info(self, port: int) -> AsyncServiceInfo:
        """The registration this fake advertises: the TXT keys of a real prefill node."""
        props = {
            "id": self.id,
            "name": self.name,
            "roles": "prefill",
            "proto": str(PROTO),
            "model": self.model_fp()[:16],
            "device": "cuda",
            "mem": str(1 << 30),
        }
        return AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.name}.{SERVICE_TYPE}",
            port=port,
            properties=props,
            server=f"{self.id}.local.",
            parsed_addresses=["127.0.0.1"],
        )


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """Serve `app` on a free loopback port; yields the port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def in_thread_poll(check: Any, timeout: float) -> Any:
    """`poll` off the event loop, so the fakes this loop serves keep answering."""
    return await asyncio.to_thread(poll, check, timeout)


# -- real node processes ---------------------------------------------------------------------


def test_two_nodes_find_and_trust_each_other_within_5s(
    pair: tuple[MdnsNode, MdnsNode, float], fp: str
) -> None:
    prefill, decode, t_up = pair
    pid, did = prefill.get("/health")["id"], decode.get("/health")["id"]

    seen_prefill, seen_decode = poll(lambda: mutual_trust(prefill, pid, decode, did), 5.0)
    took = time.monotonic() - t_up
    print(f"discovery: mutual trust {took:.2f} s after both nodes answered /health")
    assert took < 5.0
    assert seen_prefill["address"] == prefill.url and seen_decode["address"] == decode.url
    assert seen_prefill["roles"] == ["prefill"] and seen_decode["roles"] == ["decode"]
    assert seen_prefill["source"] == "mdns" and seen_prefill["reason"] is None
    assert seen_prefill["model"]["fingerprint"] == fp
    assert seen_prefill["name"] == seen_decode["name"] == "twin"


async def test_own_browser_sees_the_txt_keys(
    pair: tuple[MdnsNode, MdnsNode, float], fp: str
) -> None:
    prefill, decode, _ = pair
    want = {n.get("/health")["id"]: n for n in (prefill, decode)}
    names: set[str] = set()

    def on_change(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        names.add(name)

    found: dict[str, AsyncServiceInfo] = {}
    async with AsyncZeroconf(interfaces=["127.0.0.1"]) as azc:
        browser = AsyncServiceBrowser(azc.zeroconf, SERVICE_TYPE, handlers=[on_change])
        deadline = time.monotonic() + 5.0
        while set(want) - set(found) and time.monotonic() < deadline:
            for name in list(names):
                info = await azc.async_get_service_info(SERVICE_TYPE, name, timeout=1000)
                node_id = info.decoded_properties.get("id") if info else None
                if info is not None and node_id in want:
                    found[node_id] = info
            await asyncio.sleep(0.1)
        await browser.async_cancel()
    assert set(found) == set(want), f"saw {sorted(names)}"
    for node_id, info in found.items():
        node, props = want[node_id], info.decoded_properties
        assert set(props) >= TXT_KEYS
        assert props["roles"] == ("prefill" if node is prefill else "decode")
        assert props["name"] == "twin" and props["proto"] == str(PROTO)
        assert props["model"] == fp[:16]
        assert int(props["mem"] or 0) > 0 and props["device"]
        assert info.port == node.port
        assert info.parsed_addresses(IPVersion.All) == ["127.0.0.1"]
        assert node_id[:8] in info.name  # one --name, two instance names
    assert len({info.name for info in found.values()}) == 2


def test_sigkilled_node_is_unreachable_within_10s_and_trusted_again_on_return(
    tmp_path: Path, model: Path, pair: tuple[MdnsNode, MdnsNode, float]
) -> None:
    _, decode, _ = pair
    doomed = start_mdns_node(tmp_path, model, "prefill", "--name", "doomed")
    try:
        doomed_id = doomed.get("/health")["id"]

        def state() -> dict | None:
            return peer(decode.get("/v1/cluster"), doomed_id)

        poll(lambda: trusted_by(decode, doomed_id), 10.0)
        doomed.proc.send_signal(signal.SIGKILL)  # no goodbye: zeroconf keeps its records
        doomed.proc.wait()
        t0 = time.monotonic()
        gone = poll(lambda: (p := state()) and p["reason"] == "unreachable" and p, 10.0)
        print(f"SIGKILL: unreachable after {time.monotonic() - t0:.2f} s")
        assert not gone["trusted"]

        back = start_mdns_node(tmp_path, model, "prefill", "--name", "doomed", port=doomed.port)
        doomed = back
        assert back.get("/health")["id"] == doomed_id  # the id persists per port
        poll(lambda: trusted_by(decode, doomed_id), 10.0)
    finally:
        doomed.stop()


async def test_spoofed_registrations_are_rejected_and_never_get_a_prompt_or_token(
    guarded: MdnsNode, fp: str
) -> None:
    fakes = [
        FakeNode("liar", "wrong_proof", fp),
        FakeNode("stranger", "other_model", fp),
        FakeNode("elder", "old_proto", fp),
    ]
    expected = {
        "fake-liar": "unauthorized",
        "fake-stranger": "model_mismatch",
        "fake-elder": "protocol_mismatch",
    }
    async with (
        serving(fakes[0].app()) as p0,
        serving(fakes[1].app()) as p1,
        serving(fakes[2].app()) as p2,
        AsyncZeroconf(interfaces=["127.0.0.1"]) as azc,
    ):
        infos = [f.info(p) for f, p in zip(fakes, (p0, p1, p2), strict=True)]
        await asyncio.gather(*(_register(azc, i) for i in infos))

        def listed() -> dict[str, dict] | None:
            cluster = guarded.get("/v1/cluster")
            got = {i: peer(cluster, i) for i in expected}
            ok = all(p and p["reason"] == expected[i] for i, p in got.items())
            return got if ok else None

        rejected = await in_thread_poll(listed, 15.0)
        assert all(p["trusted"] is False and p["source"] == "mdns" for p in rejected.values())

        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        reply = await asyncio.to_thread(guarded.post, "/v1/chat/completions", body)
        assert reply["tandem"]["prefill"] == "local"

        for fake in fakes:
            assert "/health" in fake.paths
            assert not [p for p in fake.paths if not p.startswith(("/health", "/v1/hello"))]
            assert all("Authorization" not in h for _, h in fake.requests)
            assert all("X-Tandem-Signature" not in h for _, h in fake.requests)
        assert "/v1/hello" in fakes[0].paths and "/v1/hello" in fakes[1].paths
        for info in infos:
            await azc.async_unregister_service(info)


async def test_follows_model_change_address_change_and_goodbye(guarded: MdnsNode, fp: str) -> None:
    fake = FakeNode("chameleon", "honest", fp)

    def entry() -> dict | None:
        return peer(guarded.get("/v1/cluster"), fake.id)

    async with (
        serving(fake.app()) as port,
        serving(fake.app()) as new_port,
        AsyncZeroconf(interfaces=["127.0.0.1"]) as azc,
    ):
        info = fake.info(port)
        await _register(azc, info)
        first = await in_thread_poll(lambda: (p := entry()) and p["trusted"] and p, 10.0)
        assert first["address"] == url_for("127.0.0.1", port)

        fake.behaviour = "other_model"  # restarted with another model: TXT follows
        t0 = time.monotonic()
        await (await azc.async_update_service(fake.info(port)))
        await in_thread_poll(lambda: (p := entry()) and p["reason"] == "model_mismatch", 5.0)
        print(f"model change noticed after {time.monotonic() - t0:.2f} s")

        await (await azc.async_update_service(fake.info(new_port)))  # moved to another port

        def moved() -> bool:
            addresses = [p["address"] for p in guarded.get("/v1/cluster")["peers"]]
            return url_for("127.0.0.1", new_port) in addresses and first["address"] not in (
                addresses
            )

        await in_thread_poll(moved, 5.0)

        t0 = time.monotonic()
        await (await azc.async_unregister_service(fake.info(new_port)))  # goodbye
        await in_thread_poll(lambda: entry() is None, 5.0)
        print(f"goodbye noticed after {time.monotonic() - t0:.2f} s")


async def _register(azc: AsyncZeroconf, info: AsyncServiceInfo) -> None:
    await (await azc.async_register_service(info))


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
