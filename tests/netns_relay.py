"""The relay of tests/trust_support.py as a process, for a relay on a LAN address inside a
network namespace (tests/test_netns.py): it holds no token, serves HTTPS with its own
self-signed certificate, passes /health and the hello on to `--target` (a real node) and
writes every request it gets (path, headers, body) to `--log` as JSON lines.

    python -m tests.netns_relay --host ADDR --port PORT --target URL --cert-dir DIR --log FILE

It prints one line, `relaying URL (certificate sha256:FP) to TARGET`, once it listens, and
stops on SIGTERM or SIGINT. `RelayProcess` starts it (under `ip netns exec`) and stops it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from tandem.nodes.trust.tls import load_or_create

from tests.nodeproc import stop_process
from tests.trust_support import Log, relay, serving

READY = "relaying "
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FileLog(Log):
    """A `Log` that also appends each request to `file`, so another process can read it."""

    file: Path | None = None

    def middleware(self) -> web.middleware:
        keep = super().middleware()

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            body = (await request.read()).decode(errors="replace")  # cached for the handler
            line = {"path": request.path, "headers": dict(request.headers), "body": body}
            assert self.file is not None
            with open(self.file, "a") as f:
                f.write(json.dumps(line) + "\n")
            return await keep(request, handler)

        return record


def read_log(path: Path) -> tuple[Log, str]:
    """What the relay wrote to `path`: as a `Log` (paths and headers), and the raw text."""
    text = path.read_text() if path.exists() else ""
    lines = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return Log([(ln["path"], ln["headers"]) for ln in lines]), text


async def _main(args: argparse.Namespace) -> None:
    identity = load_or_create(Path(args.cert_dir), "relay")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = relay(args.target, FileLog(file=Path(args.log)))
    async with serving(app, identity, args.port, args.host) as url:
        print(f"{READY}{url} (certificate sha256:{identity.fingerprint}) to {args.target}")
        sys.stdout.flush()
        await stop.wait()


@dataclass
class RelayProcess:
    """A relay process, run inside network namespace `netns`."""

    proc: subprocess.Popen[bytes]
    url: str
    fingerprint: str  # of the certificate it serves
    log: Path  # the requests it got, as JSON lines
    out: Path  # its stdout and stderr

    @classmethod
    def start(
        cls, tmp: Path, netns: str, host: str, port: int, target: str, timeout: float = 15.0
    ) -> RelayProcess:
        """Start a relay on `host`:`port` in `netns` to `target`; returns once it listens."""
        stem = f"relay-{port}-{time.monotonic_ns()}"
        log, out = tmp / f"{stem}.jsonl", tmp / f"{stem}.out"
        cmd = ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.netns_relay"]
        cmd += ["--host", host, "--port", str(port), "--target", target]
        cmd += ["--cert-dir", str(tmp / stem), "--log", str(log)]
        with open(out, "wb") as f:  # ip execs python: the pid is the relay's
            proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=f, stderr=f)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = out.read_text(errors="replace")
            ready = next((ln for ln in text.splitlines() if ln.startswith(READY)), None)
            if ready is not None:
                url, rest = ready.removeprefix(READY).split(" ", 1)
                fingerprint = rest.split("sha256:", 1)[1].split(")", 1)[0]
                return cls(proc, url, fingerprint, log, out)
            if proc.poll() is not None:
                raise RuntimeError(f"relay exited with {proc.returncode}:\n{text}")
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        raise TimeoutError(f"relay not listening within {timeout} s:\n{out.read_text()}")

    def stop(self, timeout: float = 5.0) -> int:
        return stop_process(self.proc, timeout=timeout)

    def output(self) -> str:
        return self.out.read_text(errors="replace")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--cert-dir", required=True)
    parser.add_argument("--log", required=True)
    asyncio.run(_main(parser.parse_args()))
