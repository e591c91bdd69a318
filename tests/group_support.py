"""A decode group for tests: `mlx.launch -n 2 --backend ring` on loopback running `tandem node
--role decode`, rank 0 serving on a free port (tests/nodeproc.py's `NodeProc`, whose process
is mlx.launch's: stopping it stops the group)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.nodeproc import ROOT, NodeProc, free_port

LAUNCH = Path(sys.executable).parent / "mlx.launch"


def ring_port() -> int:
    """A free port to start the ring's from (rank r listens on it + r), below the kernel's
    ephemeral range: a port from that range can be taken by any connection another test
    opens between this check and the ranks' bind (mlx's ring: "Couldn't bind socket")."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(max(1024, low - 12000), low - 2)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def start_group(
    tmp: Path,
    model: Path,
    *args: str,
    token: str,
    ranks: int = 2,
    launcher: bool = False,
    other_token: str | None = None,
    between: Callable[[int], None] | None = None,
) -> NodeProc:
    """A decode node as a group of `ranks` (not waited for: `wait_healthy` it): each rank a
    `tandem node --role decode` with the environment `mlx.launch` gives it (`MLX_RANK`,
    `MLX_HOSTFILE`: the ring on loopback), started here, or by `mlx.launch` itself with
    `launcher` (whose output relay polls a core busy while the group runs: mlx 0.32). The
    NodeProc is rank 0's (or mlx.launch's); stop it, then `stop_ranks`. Without the launcher:
    the other ranks read `other_token` where given, and `between(ring port)` runs once rank 0
    is started and before the others are."""
    port = free_port()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / f"config-{port}")}
    env.pop("TANDEM_TOKEN", None)
    token_file = tmp / f"token-{port}"
    token_file.write_text(token)
    node = [
        sys.executable, "-m", "tandem.app", "node", "--role", "decode", "--model", str(model),
        "--port", str(port), "--no-mdns", "--token-file", str(token_file), *args,
    ]  # fmt: skip
    ring = ring_port()
    if launcher:
        cmd = [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--starting-port", str(ring),
               "--", *node]  # fmt: skip
        return _spawn(cmd, env, tmp / f"group-{port}.log", port, token)
    hostfile = tmp / f"hosts-{port}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring + r}"] for r in range(ranks)]))
    env["MLX_HOSTFILE"] = str(hostfile)
    others = node
    if other_token is not None:
        other_file = tmp / f"other-token-{port}"
        other_file.write_text(other_token)
        others = [str(other_file) if a == str(token_file) else a for a in node]
    rank0 = None
    if between is not None:
        rank0 = _spawn(node, {**env, "MLX_RANK": "0"}, tmp / f"group-{port}.log", port, token)
        between(ring)
    for r in range(ranks - 1, 0, -1):
        _spawn(others, {**env, "MLX_RANK": str(r)}, tmp / f"group-{port}-rank{r}.log", port,
               token)  # fmt: skip
    return rank0 or _spawn(node, {**env, "MLX_RANK": "0"}, tmp / f"group-{port}.log", port, token)


def _spawn(cmd: list[str], env: dict[str, str], log: Path, port: int, token: str) -> NodeProc:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return NodeProc(proc, port, log, token)


def stop_ranks(group: NodeProc) -> None:
    """Whatever is left of a group once rank 0 (or mlx.launch) was stopped: killed."""
    deadline = time.monotonic() + 10
    while rank_pids(group) and time.monotonic() < deadline:
        time.sleep(0.2)  # rank 0's stop order: the others exit by themselves
    for pid in rank_pids(group).values():
        os.kill(pid, signal.SIGKILL)


def rank_pids(group: NodeProc) -> dict[int, int]:
    """The group's node processes by rank (from their environment's MLX_RANK)."""
    out = subprocess.run(
        ["pgrep", "-f", "--", f"--port {group.port} "], capture_output=True, text=True
    )
    found = {}
    for pid in map(int, out.stdout.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"MLX_RANK="):
                found[int(item[9:])] = pid
    return found
