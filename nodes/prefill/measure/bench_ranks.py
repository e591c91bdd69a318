"""`tandem bench prefill --ranks N`: the same prompt through this process's one-device engine
and through one prefill node of N ranks (issue 52), each rank its share of every layer on its
own device and its own link (`--link-gbps` throttles each), launched by torch's launcher on
this machine (gloo on the CPU; NCCL where the device is CUDA and N cards are visible). The two
run in turns (one device, then the ranks, `repeat` times) so that a slow spell of a shared
machine weighs on both; the ranks' side is `ranks/bench.py`, which waits for each turn on a
loopback socket. torch.distributed stays in the ranks' processes.

Medians over the turns: `ranks_bytes_streamed` (each rank's weight bytes per pass),
`ranks_reduced_bytes_per_layer` (each rank's all-reduce bytes / layers), `ranks_pass_s` and
`ranks_compute_s` (each rank's pass), `ranks_wall_s` (rank 0's pass, as `wall_s` is timed)
against `one_device_wall_s`, and `ranks_ratio`, the median of each turn's ranks / one device
(≈ 1/N where the link binds and nothing more stays resident; a rank holds half of each layer,
so the same budget keeps more of them: `ranks_resident_layers`).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn

import torch
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning import ram

TURN_TIMEOUT_S = 600.0  # the ranks' start, warm-up or one pass: longer is a stuck rank
TAIL_LINES = 40  # of the ranks' output, in the error that says one failed


def launcher_command(
    n: int, out: Path, model: Path, prompt: Path, budget: int, *, link_gbps: float | None,
    device: str, chunk_tokens: int, host_budget: ram.HostBudget | None, turns: int | None,
) -> list[str]:  # fmt: skip
    """The command that starts `n` ranks of `ranks/bench.py` on this machine (torch's own
    launcher, a rendezvous of its own on a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", "-m", "tandem.nodes.prefill.ranks.bench",
           str(out), str(model), str(prompt), f"--budget={budget}", f"--device={device}",
           f"--chunk-tokens={chunk_tokens}", f"--host-budget={host_budget or 0}"]  # fmt: skip
    if link_gbps is not None:
        cmd.append(f"--link-gbps={link_gbps}")
    if turns is not None:
        cmd.append(f"--turns={turns}")
    return cmd


def _env(n: int, device: str) -> dict[str, str]:
    """CPU ranks: gloo over loopback, and this process's compute threads shared among them."""
    env = dict(os.environ)
    if device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
        env["OMP_NUM_THREADS"] = str(max(1, torch.get_num_threads() // n))
    return env


def _ranks_device(engine: PrefillEngine, n: int) -> str:
    kind = engine.device.type
    if kind == "cuda" and torch.cuda.device_count() < n:
        raise RuntimeError(f"--ranks {n}: {torch.cuda.device_count()} CUDA devices visible")
    if kind not in ("cuda", "cpu"):
        raise RuntimeError(f"--ranks: ranks run on CUDA or the CPU, not {kind}")
    return kind


class LaunchedRanks:
    """The launched ranks, their output in a file, rank 0 on the end of a loopback socket."""

    def __init__(self, cmd: list[str], env: dict[str, str], server: socket.socket, log: IO[bytes]):
        self.log = log
        self.conn: socket.socket | None = None
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.conn = self._wait(lambda: server.accept()[0])
        self.conn.settimeout(1.0)

    def turn(self) -> None:
        """One pass of the ranks, waited for."""
        conn = self.conn
        assert conn is not None
        conn.sendall(b"\n")
        if self._wait(lambda: conn.recv(1)) != b"\n":  # b"": rank 0 is gone
            self.failed()

    def finish(self) -> None:
        """After the last turn: the ranks write their passes and exit."""
        assert self.conn is not None
        self.conn.close()
        try:
            self.proc.wait(TURN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.failed(f"no rank exited in {TURN_TIMEOUT_S:.0f} s")
        if self.proc.returncode:
            self.failed()

    def close(self) -> None:
        """Stop the ranks if they still run (the launcher stops its workers)."""
        if self.conn is not None:
            self.conn.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _wait(self, step: Callable[[], Any]) -> Any:
        """`step` (a blocking socket call, a second at a time) once it answers; a rank that
        exits or takes longer than TURN_TIMEOUT_S fails the bench."""
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return step()
            except TimeoutError:
                if self.proc.poll() is not None:
                    self.failed()
        self.failed(f"rank 0 did not answer in {TURN_TIMEOUT_S:.0f} s")

    def failed(self, why: str = "a rank failed") -> NoReturn:
        """Stop the ranks; a RuntimeError that says why and ends with their output's tail."""
        self.close()
        self.log.flush()
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
        rc = self.proc.returncode
        raise RuntimeError(f"--ranks: {why} (launcher exit {rc}); the ranks' output ends:\n"
                           + "\n".join(tail))  # fmt: skip


def vs_ranks(
    n: int, model: Path, engine: PrefillEngine, one_pass: Callable[[], float], ids: list[int],
    repeat: int, before: Callable[[], None], link_gbps: float | None,
    host_budget: ram.HostBudget | None,
) -> dict[str, object]:  # fmt: skip
    """`ids` through `engine` (`one_pass`: its pass's wall seconds) and through `n` ranks of
    its model, budget and link, in turns (see the module doc)."""
    device = _ranks_device(engine, n)
    with tempfile.TemporaryDirectory(prefix="tandem-ranks-") as tmp, \
            socket.create_server(("127.0.0.1", 0)) as server, \
            open(Path(tmp) / "log", "w+b") as log:  # fmt: skip
        server.settimeout(1.0)
        out, prompt = Path(tmp) / "passes.json", Path(tmp) / "prompt.json"
        prompt.write_text(json.dumps(ids))
        cmd = launcher_command(
            n, out, model, prompt, engine.budget, link_gbps=link_gbps,
            device=device, chunk_tokens=engine.chunk_tokens, host_budget=host_budget,
            turns=server.getsockname()[1],
        )  # fmt: skip
        ranks = LaunchedRanks(cmd, _env(n, device), server, log)
        try:
            one = []
            for _ in range(repeat):
                before()
                one.append(one_pass())
                before()
                ranks.turn()
            ranks.finish()
        finally:
            ranks.close()
        ran = json.loads(out.read_text())
    return _result(ran, one)


def _result(ran: dict[str, Any], one: list[float]) -> dict[str, object]:
    """The JSON keys (`tandem bench prefill --ranks N --json`)."""
    passes, layers = ran["passes"], ran["layers"]

    def per_rank(key: str, scale: float = 1.0) -> list[float]:
        by_rank = zip(*([r[key] for r in p["records"]] for p in passes), strict=True)
        return [statistics.median(values) / scale for values in by_rank]

    return {
        "ranks": ran["world"],
        "ranks_backend": ran["backend"],
        "ranks_resident_layers": [r["resident_layers"] for r in ran["ranks"]],
        "ranks_bytes_streamed": [int(b) for b in per_rank("bytes_streamed")],
        "ranks_reduced_bytes_per_layer": per_rank("reduced_bytes", layers),
        "ranks_pass_s": per_rank("seconds"),
        "ranks_compute_s": per_rank("compute_s"),
        "ranks_wall_s": statistics.median(p["wall_s"] for p in passes),
        "one_device_wall_s": statistics.median(one),
        "ranks_ratio": statistics.median(p["wall_s"] / w for p, w in zip(passes, one, strict=True)),
    }


def table_lines(r: dict[str, Any]) -> str:
    """The ranks' lines of the bench's table ("" without `--ranks`)."""
    if "ranks_ratio" not in r:
        return ""

    def mib(values: list[float]) -> str:
        return ", ".join(f"{v / 2**20:.2f}" for v in values)

    return (
        f"\n  ranks       {r['ranks']} ({r['ranks_backend']}): {r['ranks_wall_s']:.3f} s a pass"
        f" against one device's {r['one_device_wall_s']:.3f} s; ranks / one {r['ranks_ratio']:.3f}"
        f" (turn by turn, median)\n"
        f"              per rank: streamed {mib(r['ranks_bytes_streamed'])} MiB a pass,"
        f" all-reduce {mib(r['ranks_reduced_bytes_per_layer'])} MiB a layer,"
        f" pass {', '.join(f'{s:.3f}' for s in r['ranks_pass_s'])} s"
    )
