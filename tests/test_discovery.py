"""mDNS discovery and peer trust: real node processes on loopback, the test's own zeroconf,
and fake nodes the test controls (DESIGN.md: mDNS, `/v1/hello`, `/v1/cluster`)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tandem.nodes.cluster.mdns_records import url_for
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.contract.http import PROTO, SERVICE_TYPE
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from tests import fake_peer_support
from tests.discovery_support import MdnsNode, mutual_trust, peer, poll, start_mdns_node, trusted_by
from tests.fake_peer_support import TOKEN, FakeNode, serving
from tests.nodeproc import wait_healthy
from tests.records import stats_of

TXT_KEYS = {"id", "name", "roles", "proto", "model", "device", "mem"}
model = fake_peer_support.model  # this module's tiny model and its fingerprint (fixtures)
fp = fake_peer_support.fp


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


async def in_thread_poll(check: Any, timeout: float) -> Any:
    """`poll` off the event loop, so the fakes this loop serves keep answering."""
    return await asyncio.to_thread(poll, check, timeout)


# -- real node processes ---------------------------------------------------------------------


def test_two_nodes_find_and_trust_each_other_within_5s(
    pair: tuple[MdnsNode, MdnsNode, float], fp: str
) -> None:
    prefill, decode, t_up = pair
    pid, did = prefill.health().id, decode.health().id

    seen_prefill, seen_decode = poll(lambda: mutual_trust(prefill, pid, decode, did), 5.0)
    took = time.monotonic() - t_up
    print(f"discovery: mutual trust {took:.2f} s after both nodes answered /health")
    assert took < 5.0
    assert seen_prefill.address == prefill.url and seen_decode.address == decode.url
    assert seen_prefill.roles == ("prefill",) and seen_decode.roles == ("decode",)
    assert seen_prefill.source == "mdns" and seen_prefill.reason is None
    assert seen_prefill.model["fingerprint"] == fp
    assert seen_prefill.name == seen_decode.name == "twin"


async def test_own_browser_sees_the_txt_keys(
    pair: tuple[MdnsNode, MdnsNode, float], fp: str
) -> None:
    prefill, decode, _ = pair
    want = {n.health().id: n for n in (prefill, decode)}
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
        doomed_id = doomed.health().id

        def state() -> Peer | None:
            return peer(decode.cluster(), doomed_id)

        poll(lambda: trusted_by(decode, doomed_id), 10.0)
        doomed.proc.send_signal(signal.SIGKILL)  # no goodbye: zeroconf keeps its records
        doomed.proc.wait()
        t0 = time.monotonic()
        gone = poll(lambda: (p := state()) and p.reason == "unreachable" and p, 10.0)
        print(f"SIGKILL: unreachable after {time.monotonic() - t0:.2f} s")
        assert not gone.trusted

        back = start_mdns_node(tmp_path, model, "prefill", "--name", "doomed", port=doomed.port)
        doomed = back
        assert back.health().id == doomed_id  # the id persists per port
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

        def listed() -> dict[str, Peer | None] | None:
            cluster = guarded.cluster()
            got = {i: peer(cluster, i) for i in expected}
            ok = all(p and p.reason == expected[i] for i, p in got.items())
            return got if ok else None

        rejected = await in_thread_poll(listed, 15.0)
        assert all(p.trusted is False and p.source == "mdns" for p in rejected.values())

        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        reply = await asyncio.to_thread(guarded.post, "/v1/chat/completions", body)
        assert stats_of(reply).prefill == "local"

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

    def entry() -> Peer | None:
        return peer(guarded.cluster(), fake.id)

    async with (
        serving(fake.app()) as port,
        serving(fake.app()) as new_port,
        AsyncZeroconf(interfaces=["127.0.0.1"]) as azc,
    ):
        info = fake.info(port)
        await _register(azc, info)
        first = await in_thread_poll(lambda: (p := entry()) and p.trusted and p, 10.0)
        assert first.address == url_for("127.0.0.1", port)

        fake.behaviour = "other_model"  # restarted with another model: TXT follows
        t0 = time.monotonic()
        await (await azc.async_update_service(fake.info(port)))
        await in_thread_poll(lambda: (p := entry()) and p.reason == "model_mismatch", 5.0)
        print(f"model change noticed after {time.monotonic() - t0:.2f} s")

        await (await azc.async_update_service(fake.info(new_port)))  # moved to another port

        def moved() -> bool:
            addresses = [p.address for p in guarded.cluster().peers]
            return url_for("127.0.0.1", new_port) in addresses and first.address not in addresses

        await in_thread_poll(moved, 5.0)

        t0 = time.monotonic()
        await (await azc.async_unregister_service(fake.info(new_port)))  # goodbye
        await in_thread_poll(lambda: entry() is None, 5.0)
        print(f"goodbye noticed after {time.monotonic() - t0:.2f} s")


async def _register(azc: AsyncZeroconf, info: AsyncServiceInfo) -> None:
    await (await azc.async_register_service(info))
