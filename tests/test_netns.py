"""Discovery and a remote prefill across a real link: network namespaces joined by veth pairs,
a node in each (needs root and iproute2; skips itself otherwise, always cleans up)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.contract.http import SERVICE_TYPE

from tests.discovery_support import MdnsNode, mutual_trust, peer, poll, start_mdns_node, trusted_by
from tests.netns_relay import RelayProcess, read_log
from tests.nodeproc import free_port, stop_all, wait_healthy
from tests.records import peer_at, stats_of

pytestmark = pytest.mark.netns
TOKEN = "netns-test-token-0123456789"
PREFIX = "tdmt"  # namespaces are named PREFIX + pid + letter
HINT = "--peer https://HOST:PORT"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _sysctl(ns: str, key: str, value: str) -> None:
    """Set a network sysctl inside `ns` (no procps needed: /proc/sys/net is per namespace)."""
    path = "/proc/sys/" + key.replace(".", "/")
    code = f"open({path!r}, 'w').write({value!r})"
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True)


def _why_not() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create network namespaces: {e}"
    _ip("netns", "del", probe)
    return None


def _sweep_stale() -> None:
    """Delete namespaces left by test runs whose process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        digits = name.removeprefix(PREFIX).rstrip("abcdefghijklmnopqrstuvwxyz")
        if name.startswith(PREFIX) and digits.isdigit() and not Path(f"/proc/{digits}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Lab:
    """Namespaces, veth links and node processes, all removed by `close`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.namespaces: list[str] = []
        self.nodes: list[MdnsNode] = []

    def netns(self, letter: str) -> str:
        name = f"{PREFIX}{os.getpid()}{letter}"
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        for scope in ("all", "default"):  # addresses usable at once, no DAD wait
            _sysctl(name, f"net.ipv6.conf.{scope}.accept_dad", "0")
        return name

    def link(self, a: str, a_addr: str, b: str, b_addr: str) -> None:
        """A veth pair `a` ↔ `b` with one address (CIDR) on each end, both up."""
        dev_a, dev_b = f"to-{b[-1]}", f"to-{a[-1]}"
        _ip("link", "add", dev_a, "netns", a, "type", "veth", "peer", "name", dev_b, "netns", b)
        for ns, dev, addr in ((a, dev_a, a_addr), (b, dev_b, b_addr)):
            _ip("-n", ns, "addr", "add", addr, "dev", dev, *(["nodad"] if ":" in addr else []))
            _ip("-n", ns, "link", "set", dev, "up")

    def routed(self, net: str) -> tuple[str, str, str]:
        """Namespaces a and b on subnets `net`.1.0/24 and `net`.2.0/24 (each at .2), and r
        routing between them (.1 on both): (a, r, b)."""
        a, r, b = self.netns("a"), self.netns("r"), self.netns("b")
        self.link(a, f"{net}.1.2/24", r, f"{net}.1.1/24")
        self.link(b, f"{net}.2.2/24", r, f"{net}.2.1/24")
        _sysctl(r, "net.ipv4.ip_forward", "1")
        _ip("-n", a, "route", "add", "default", "via", f"{net}.1.1")
        _ip("-n", b, "route", "add", "default", "via", f"{net}.2.1")
        return a, r, b

    def node(
        self,
        ns: str,
        host: str,
        role: str,
        *args: str,
        model: Path,
        port: int | None = None,
        token: str = TOKEN,
    ) -> MdnsNode:
        node = start_mdns_node(
            self.tmp, model, role, *args, token=token, host=host, netns=ns, port=port, wait=False
        )
        self.nodes.append(node)
        return node

    def close(self) -> None:
        stop_all(self.nodes, timeout=5.0)  # their mDNS goodbyes overlap
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    _sweep_stale()
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return tiny_model()


@pytest.mark.parametrize(
    ("prefill_addr", "decode_addr"),
    [("10.77.0.1/24", "10.77.0.2/24"), ("fd77::1/64", "fd77::2/64")],
    ids=["ipv4", "ipv6"],
)
def test_nodes_in_two_namespaces_discover_each_other_and_prefill_remotely(
    lab: Lab, model: Path, prefill_addr: str, decode_addr: str
) -> None:
    a, b = lab.netns("a"), lab.netns("b")
    lab.link(a, prefill_addr, b, decode_addr)
    host_a, host_b = prefill_addr.split("/")[0], decode_addr.split("/")[0]
    prefill = lab.node(a, host_a, "prefill", "--name", "gpu", model=model)
    decode = lab.node(
        b, host_b, "decode", "--name", "mac", "--remote-prefill", "always", model=model
    )
    ids = [wait_healthy(n).id for n in (prefill, decode)]
    t_up = time.monotonic()

    mutual = poll(lambda: mutual_trust(prefill, ids[0], decode, ids[1]), 10.0, interval=0.2)
    seen_prefill, seen_decode = mutual
    took = time.monotonic() - t_up
    assert seen_prefill.address == prefill.url and seen_prefill.source == "mdns"
    assert seen_decode.address == decode.url
    # beyond loopback both serve TLS, and each pinned the certificate the other serves
    assert prefill.url.startswith("https://") and decode.url.startswith("https://")
    assert seen_prefill.cert_fingerprint == prefill.health().cert_fingerprint
    assert seen_decode.cert_fingerprint == decode.health().cert_fingerprint

    body = {"messages": [{"role": "user", "content": "across the link"}], "max_tokens": 4}
    stats = stats_of(decode.post("/v1/chat/completions", body))
    assert stats.prefill == "remote"
    assert stats.prefill_node == prefill.url
    print(
        f"\n[{host_a} ↔ {host_b}] mutual trust {took:.2f} s after /health; "
        f"remote prefill of {stats.prefill_tokens} tokens via "
        f"{stats.prefill_node}, {stats.kv_bytes} KV bytes, "
        f"ttft {stats.ttft_s * 1000:.0f} ms"
    )


def test_routed_subnets_block_mdns_the_node_hints_and_peer_works(lab: Lab, model: Path) -> None:
    """Multicast stays on its link: across a router, nodes only meet through --peer."""
    a, _, b = lab.routed("10.78")
    prefill = lab.node(a, "10.78.1.2", "prefill", "--name", "gpu", model=model)
    decode = lab.node(
        b, "10.78.2.2", "decode", "--name", "mac", "--peer", prefill.url,
        "--remote-prefill", "always", model=model,
    )  # fmt: skip
    prefill_id = wait_healthy(prefill).id
    wait_healthy(decode)

    hint = poll(
        lambda: next((ln for ln in prefill.output().splitlines() if HINT in ln), None), 20.0
    )
    print(f"\nwhat the user sees: {hint}")
    seen = poll(lambda: trusted_by(decode, prefill_id), 10.0)
    assert seen.source == "static"
    assert "mDNS: found" not in decode.output()
    reply = decode.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    )
    assert stats_of(reply).prefill == "remote"


def test_a_second_node_with_the_same_id_advertises_under_a_new_name(lab: Lab, model: Path) -> None:
    """A copied config dir: two nodes, one id, one name, on one link. The second one's probe
    meets the first one's records over the veth and renames itself, with a warning."""
    a, b = lab.netns("a"), lab.netns("b")
    lab.link(a, "10.79.0.1/24", b, "10.79.0.2/24")
    port = free_port()  # the same port in both: the id file (config/nodes/PORT.id) is shared
    first = lab.node(a, "10.79.0.1", "prefill", "--name", "collide", model=model, port=port)
    node_id = wait_healthy(first).id
    name = f"collide-{node_id[:8]}.{SERVICE_TYPE}"
    poll(lambda: f"mDNS: advertising {name}" in first.output(), 20.0)
    second = lab.node(b, "10.79.0.2", "prefill", "--name", "collide", model=model, port=port)
    assert wait_healthy(second).id == node_id
    renamed = f"collide-{node_id[:8]}-2.{SERVICE_TYPE}"
    poll(lambda: f"mDNS: advertising {renamed}" in second.output(), 20.0)
    assert f"{name} is already advertised" in second.output()
    assert "already advertised" not in first.output()


def test_a_lan_peer_with_another_certificate_is_refused_until_it_proves_the_token(
    lab: Lab, model: Path
) -> None:
    """Over a real link: the prefill node's address taken by a node with another certificate
    and another token is refused at once and stays refused; the real node back with a new
    certificate proves the token again and is pinned anew."""
    a, b = lab.netns("a"), lab.netns("b")
    lab.link(a, "10.80.0.1/24", b, "10.80.0.2/24")
    port = free_port()
    prefill = lab.node(a, "10.80.0.1", "prefill", "--no-mdns", model=model, port=port)
    prefill_id = wait_healthy(prefill).id
    decode = lab.node(
        b, "10.80.0.2", "decode", "--no-mdns", "--peer", prefill.url,
        "--remote-prefill", "always", model=model,
    )  # fmt: skip
    wait_healthy(decode)
    first_pin = poll(lambda: trusted_by(decode, prefill_id), 15.0).cert_fingerprint
    assert first_pin == prefill.health().cert_fingerprint

    identity = lab.tmp / "config" / "tandem" / "nodes" / str(port)  # where its cert lives
    prefill.stop(timeout=5.0)
    for name in ("cert.pem", "key.pem"):
        (identity / name).unlink()
    other = lab.node(
        a, "10.80.0.1", "prefill", "--no-mdns", model=model, port=port,
        token="another-cluster-token-0123456789",
    )  # fmt: skip
    other_pin = wait_healthy(other).cert_fingerprint
    assert other_pin != first_pin
    seen = poll(
        lambda: (p := peer(decode.cluster(), prefill_id)) and
        p.reason == "unauthorized" and p, 10.0,
    )  # fmt: skip
    assert not seen.trusted and seen.cert_fingerprint == first_pin  # nothing new pinned
    time.sleep(4.0)  # two more health checks: still refused
    assert not peer(decode.cluster(), prefill_id).trusted
    assert "does not hold this token" in decode.output()

    other.stop(timeout=5.0)
    for name in ("cert.pem", "key.pem"):
        (identity / name).unlink()
    back = lab.node(a, "10.80.0.1", "prefill", "--no-mdns", model=model, port=port)
    new_pin = wait_healthy(back).cert_fingerprint
    again = poll(lambda: trusted_by(decode, prefill_id), 15.0)
    assert again.cert_fingerprint == new_pin not in (first_pin, other_pin)
    reply = decode.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    )
    assert stats_of(reply).prefill == "remote"


def _at(node: MdnsNode, address: str) -> Peer | None:
    """`node`'s `/v1/cluster` entry for `address`."""
    return peer_at(node.cluster(), address)


def test_a_lan_relay_with_its_own_certificate_is_never_trusted_and_gets_nothing(
    lab: Lab, model: Path
) -> None:
    """Issue 19 across real links: the host between the prefill node's subnet and the decode
    node's (it routes them) runs a relay that holds no token, serves HTTPS with its own
    self-signed certificate and passes /health and the hello on to the real prefill node.
    The decode node, told of the relay and of the real node, never trusts the relay, and the
    relay gets neither the token nor a signature nor a proof; prefill still goes remote, to
    the real node, through the same host."""
    a, r, b = lab.routed("10.81")
    prefill = lab.node(a, "10.81.1.2", "prefill", "--no-mdns", model=model)
    relay = RelayProcess.start(lab.tmp, r, "10.81.2.1", free_port(), prefill.url)
    try:
        decode = lab.node(
            b, "10.81.2.2", "decode", "--no-mdns", "--peer", relay.url, "--peer", prefill.url,
            "--remote-prefill", "always", model=model,
        )  # fmt: skip
        health = wait_healthy(prefill)
        wait_healthy(decode)
        real = poll(lambda: (e := _at(decode, prefill.url)) and e.trusted and e, 15.0)
        # the relay answered the real node's /health and was asked for the hello
        poll(lambda: (e := _at(decode, relay.url)) and e.reason == "unauthorized", 10.0)
        seen = []
        t0 = time.monotonic()
        while time.monotonic() < t0 + 4.5:  # two more health checks (every 2 s)
            seen.append(_at(decode, relay.url))
            time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "who relays?"}], "max_tokens": 3}
        reply = stats_of(decode.post("/v1/chat/completions", body))
    finally:
        relay.stop()
    assert relay.url.startswith("https://") and relay.fingerprint != health.cert_fingerprint
    assert seen and all(e is not None and not e.trusted for e in seen)
    last = seen[-1]
    assert last is not None and last.reason == "unauthorized"
    assert last.id == health.id  # the real node's /health, relayed
    assert last.cert_fingerprint == ""  # nothing pinned for it
    assert real.cert_fingerprint == health.cert_fingerprint
    assert reply.prefill == "remote" and reply.prefill_node == prefill.url
    log, raw = read_log(relay.log)
    assert "/health" in log.paths and "/v1/hello" in log.paths  # asked; its proof failed
    log.assert_nothing_usable(TOKEN)
    assert TOKEN not in raw  # nor in any body it got
    assert f"peer {relay.url} not trusted" in decode.output()
    assert TOKEN not in decode.output() and TOKEN not in prefill.output()
    assert TOKEN not in relay.output()
