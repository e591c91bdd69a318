"""Child `tandem node` processes on loopback (the demo and `bench e2e`), always stopped."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Child:
    """One node process: its URL, token and log file."""

    role: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 5.0) -> dict:
        req = urllib.request.Request(self.url + path)
        req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class LocalCluster:
    """A prefill node and a decode node on this machine, sharing a generated token."""

    workdir: Path
    token: str
    children: list[Child] = field(default_factory=list)

    def start(self, role: str, model: Path, *args: str) -> Child:
        port = free_port()
        token_file = self.workdir / "token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        log_path = self.workdir / f"{role}-{port}.log"
        cmd = [sys.executable, "-m", "app.cli", "node", "--role", role, "--model", str(model)]
        cmd += ["--port", str(port), "--no-mdns", "--token-file", str(token_file), *args]
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.workdir / "config")}
        root = Path(__file__).resolve().parents[1]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        child = Child(role, port, proc, log_path, self.token)
        self.children.append(child)
        return child

    def wait_healthy(self, child: Child, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                tail = child.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{child.role} node exited:\n{tail}")
            try:
                child.get("/health")
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise TimeoutError(f"{child.role} node not healthy after {timeout:.0f} s")

    def wait_trusted(self, decode: Child, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            peers = decode.get("/v1/cluster")["peers"]
            if any(p["trusted"] and "prefill" in p["roles"] for p in peers):
                return
            time.sleep(0.1)
        raise TimeoutError("the decode node does not trust the prefill node")

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
