"""Node processes with mDNS on, on loopback or inside a network namespace, for the discovery
tests. Builds on tests/nodeproc.py (whose `start_node` runs nodes with `--no-mdns`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tandem.nodes.contract.cluster import Cluster, Peer
from tandem.nodes.trust.auth import is_loopback

from tests.nodeproc import (
    ROOT,
    NodeProc,
    free_port,
    node_command,
    node_env,
    unverified_tls,
    wait_healthy,
)

T = TypeVar("T")

# Runs inside a namespace: one HTTP request, the JSON reply on stdout.
NS_CLIENT = """
import json, ssl, sys, urllib.request
url, body, token = sys.argv[1], sys.argv[2], sys.argv[3]
req = urllib.request.Request(url, data=body.encode() if body else None)
req.add_header("Content-Type", "application/json")
if token:
    req.add_header("Authorization", "Bearer " + token)
ctx = ssl._create_unverified_context()  # nodes' certificates are self-signed
with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
    sys.stdout.write(r.read().decode())
"""


@dataclass
class MdnsNode(NodeProc):
    """A node process reached at `host`, from inside network namespace `netns` if one is set."""

    host: str = "127.0.0.1"
    netns: str | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def get(self, path: str, auth: bool = True) -> dict:
        return self.request(path, None, auth)

    def post(self, path: str, body: dict[str, Any]) -> dict:
        return self.request(path, body, auth=True)

    def request(self, path: str, body: dict[str, Any] | None, auth: bool = True) -> dict:
        token = self.token if auth and self.token else ""
        data = json.dumps(body) if body is not None else ""
        if self.netns is None:
            req = urllib.request.Request(self.url + path, data=data.encode() or None)
            req.add_header("Content-Type", "application/json")
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            context = unverified_tls() if self.tls else None
            with urllib.request.urlopen(req, timeout=30, context=context) as r:
                return json.loads(r.read())
        cmd = ["ip", "netns", "exec", self.netns, sys.executable, "-c", NS_CLIENT]
        done = subprocess.run([*cmd, self.url + path, data, token], capture_output=True, timeout=40)
        if done.returncode != 0:
            raise ConnectionError(done.stderr.decode(errors="replace")[-300:])
        return json.loads(done.stdout)


def start_mdns_node(
    tmp: Path,
    model: Path,
    role: str,
    *args: str,
    token: str | None = None,
    host: str = "127.0.0.1",
    netns: str | None = None,
    port: int | None = None,
    wait: bool = True,
) -> MdnsNode:
    """`tandem node --role ROLE` with mDNS on, on `port` or a free one; waits for /health."""
    port = port or free_port()
    log = tmp / f"node-{role}-{port}-{time.monotonic_ns()}.log"
    full_env = node_env(tmp)
    cmd = node_command(tmp, model, role, port, token, "--host", host, *args)
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]  # ip execs python: the pid is the node's
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    tls = "--tls" in args or not is_loopback(host)  # as the node decides (NodeConfig.serves_tls)
    node = MdnsNode(proc, port, log, token, tls, host=host, netns=netns)
    if wait:
        wait_healthy(node)
    return node


def poll(check: Callable[[], T | None], timeout: float, interval: float = 0.1) -> T:
    """The first truthy `check()` within `timeout` seconds; TimeoutError with the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"not within {timeout} s; last: {last!r}")


def peer(cluster: Cluster, node_id: str) -> Peer | None:
    """The entry for `node_id` in a `/v1/cluster` reply, if listed."""
    return next((p for p in cluster.peers if p.id == node_id), None)


def trusted_by(node: MdnsNode, node_id: str) -> Peer | None:
    """`node_id`'s entry in `node`'s `/v1/cluster` once `node` trusts it."""
    entry = peer(node.cluster(), node_id)
    return entry if entry and entry.trusted else None


def mutual_trust(a: MdnsNode, a_id: str, b: MdnsNode, b_id: str) -> tuple[Peer, Peer] | None:
    """(a as b lists it, b as a lists it) once each trusts the other."""
    a_seen, b_seen = trusted_by(b, a_id), trusted_by(a, b_id)
    return (a_seen, b_seen) if a_seen and b_seen else None
