"""Start real `tandem node` processes on loopback for tests, and always stop them."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tandem.app.cli.demo import free_port
from tandem.nodes.contract.cluster import Cluster, Health

__all__ = [
    "NodeProc",
    "free_port",
    "node_command",
    "node_env",
    "remote_pair",
    "start_node",
    "stop_all",
    "unverified_tls",
    "wait_healthy",
    "wait_trusted",
]
ROOT = Path(__file__).resolve().parents[1]


def unverified_tls() -> ssl.SSLContext:
    """What a test's own requests to a TLS node use: nodes' certificates are self-signed, and
    the test knows whom it started (nodes check each other by the hello and the pin)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


@dataclass
class NodeProc:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    token: str | None = None
    tls: bool = False  # started with --tls (or beyond loopback): it serves https://

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def get(self, path: str, auth: bool = True) -> dict:
        req = urllib.request.Request(self.url + path)
        if auth and self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        context = unverified_tls() if self.url.startswith("https://") else None
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return json.loads(r.read())

    def health(self) -> Health:
        """Its `/health` (no auth), read through the contract's record."""
        return Health.from_json(self.get("/health", auth=False))

    def cluster(self) -> Cluster:
        """Its `/v1/cluster`, read through the contract's record."""
        return Cluster.from_json(self.get("/v1/cluster"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        return stop_process(self.proc, sig, timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def node_command(
    tmp: Path, model: Path, role: str, port: int, token: str | None, *args: str
) -> list[str]:
    """`tandem node --role ROLE --model MODEL --port PORT ARGS`, and the token through a file
    in `tmp` when there is one."""
    cmd = [sys.executable, "-m", "tandem.app", "node", "--role", role, "--model", str(model)]
    cmd += ["--port", str(port), *args]
    if token is not None:
        token_file = tmp / f"token-{port}"
        token_file.write_text(token)
        cmd += ["--token-file", str(token_file)]
    return cmd


def node_env(tmp: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with its own config folder in `tmp` and no TANDEM_TOKEN
    (a node's token comes from `--token-file` or not at all), `env` on top."""
    full_env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config"), **(env or {})}
    full_env.pop("TANDEM_TOKEN", None)
    return full_env


def start_node(
    tmp: Path,
    model: Path,
    role: str,
    *args: str,
    token: str | None = None,
    wait: bool = True,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> NodeProc:
    """`tandem node --role ROLE` on `port` (default: a free one); waits for /health."""
    port = port or free_port()
    log = tmp / f"node-{role}-{port}.log"
    full_env = node_env(tmp, env)
    cmd = node_command(tmp, model, role, port, token, "--no-mdns", *args)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    node = NodeProc(proc, port, log, token, tls="--tls" in args)
    if wait:
        wait_healthy(node)
    return node


def wait_healthy(node: NodeProc, timeout: float = 60.0) -> Health:
    """`node`'s `/health` once it answers; RuntimeError if its process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"node exited with {node.proc.returncode}:\n{node.output()}")
        try:
            return node.health()
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.1)
    raise TimeoutError(f"node on {node.port} not healthy:\n{node.output()}")


def wait_trusted(node: NodeProc, role: str = "prefill", timeout: float = 15.0) -> Cluster:
    """`node`'s `/v1/cluster` once it lists a trusted peer with `role`."""
    deadline = time.monotonic() + timeout
    cluster: Cluster | None = None
    while time.monotonic() < deadline:
        cluster = node.cluster()
        if any(p.trusted and role in p.roles for p in cluster.peers):
            return cluster
        time.sleep(0.1)
    raise TimeoutError(f"no trusted {role} peer: {cluster}")


@contextmanager
def remote_pair(
    tmp: Path, model: Path, budget: str, token: str, *prefill_args: str
) -> Iterator[tuple[NodeProc, NodeProc]]:
    """A prefill node with `budget` (and `prefill_args`) and a decode node that always
    prefills on it, once the decode node trusts it; both stopped on exit."""
    # both start at once (imports and model loads overlap); the decode node keeps dialling
    # its peer until the prefill node answers
    prefill = start_node(
        tmp, model, "prefill", "--budget", budget, *prefill_args, token=token, wait=False
    )
    nodes = [prefill]
    try:
        decode = start_node(
            tmp, model, "decode", "--peer", prefill.url, "--remote-prefill", "always",
            token=token, wait=False,
        )  # fmt: skip
        nodes.insert(0, decode)
        wait_healthy(prefill)
        wait_healthy(decode)
        wait_trusted(decode)
        yield prefill, decode
    finally:
        stop_all(nodes)


def stop_all(nodes: Iterable[NodeProc], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Signal every node still running, then wait for them all (up to `timeout` in all, then
    kill): their shutdowns (engine closes, mDNS goodbyes) overlap instead of adding up."""
    procs = [n.proc for n in nodes if n.proc.poll() is None]
    for proc in procs:
        proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_process(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0
) -> int:
    """Signal `proc` (if it still runs), wait up to `timeout`, then kill it; its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
