"""The driver's child processes (stdlib only: the parent never touches CUDA): each section
re-runs the script with `--section NAME`, under a time limit of its own and the check's
deadline."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .context import say
from .sizes import Json

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"  # a section child re-runs it: the same bootstrap


@dataclass
class Child:
    """A section's subprocess: stdout kept, stderr passed on line by line and kept too."""

    name: str
    proc: subprocess.Popen[str]
    started: float = field(default_factory=time.monotonic)
    stdout: deque[str] = field(default_factory=lambda: deque(maxlen=2000))
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=4000))
    flagged: list[str] = field(default_factory=list)  # CSAN lines, whatever scrolls past
    readers: list[threading.Thread] = field(default_factory=list)
    ended: float | None = None  # when its stdout closed: it has exited

    def __post_init__(self) -> None:
        for stream, lines, echo in (
            (self.proc.stdout, self.stdout, False),
            (self.proc.stderr, self.stderr, True),
        ):
            reader = threading.Thread(target=self._read, args=(stream, lines, echo), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, stream: IO[str] | None, lines: deque[str], echo: bool) -> None:
        assert stream is not None
        for line in stream:
            line = line.rstrip("\n")
            lines.append(line)
            if echo:
                print(f"  [{self.name}] {line[:300]}", file=sys.stderr, flush=True)
                if "CSAN" in line or "data race" in line:
                    self.flagged.append(line)
        if not echo:
            self.ended = time.monotonic()

    def kill(self) -> None:
        """End it and whatever it started (its own session), if it still runs."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def wait(self, until: float) -> Json:
        """Its JSON, or why there is none; killed past `until`."""
        try:
            self.proc.wait(timeout=max(0.1, until - time.monotonic()))
            why = f"exited {self.proc.returncode} without a report"
        except subprocess.TimeoutExpired:
            self.kill()
            why = f"timed out after {time.monotonic() - self.started:.0f} s"
        for reader in self.readers:
            reader.join(timeout=5)
        for line in reversed(self.stdout):
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    report = json.loads(line)
                    if why.startswith("timed out"):  # it hung after reporting
                        report["exit"] = why
                    return report
        return {"ok": False, "error": why, "stderr_tail": list(self.stderr)[-10:]}


class Runner:
    """Starts sections under the check's overall deadline."""

    def __init__(self, smoke: bool, deadline: float, work: Path | None = None) -> None:
        self.smoke = smoke
        self.deadline = deadline
        self.work = work
        self.children: list[Child] = []

    def start(
        self, name: str, argv: list[str] | None = None, env: dict[str, str] | None = None
    ) -> Child:
        if argv is None:
            argv = [sys.executable, str(SCRIPT), "--section", name]
            argv += ["--work", str(self.work)] if self.work else []
            argv += ["--cpu-smoke"] if self.smoke else []
        base = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**base, **(env or {})},
            text=True,
            errors="replace",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        say(f"gpu-check: {name} ...")
        self.children.append(Child(name, proc))
        return self.children[-1]

    def close(self) -> None:
        for child in self.children:
            child.kill()

    def finish(self, child: Child, limit_s: float) -> Json:
        result = child.wait(min(child.started + limit_s, self.deadline))
        result["wall_s"] = round((child.ended or time.monotonic()) - child.started, 2)
        state = "ok" if result.get("ok") else ("skipped" if result.get("ok") is None else "FAILED")
        say(
            f"gpu-check: {child.name} {state} ({result['wall_s']} s)"
            + (f": {result.get('error')}" if result.get("error") else "")
        )
        return result

    def section(self, name: str, limit_s: float, **kw: Any) -> Json:
        if self.deadline - time.monotonic() < 5:
            return {"ok": False, "error": "skipped: the check ran out of time"}
        return self.finish(self.start(name, **kw), limit_s)

    def sanitizer(self, limit_s: float, cuda: bool) -> Json:
        """The sanitized requests under TORCH_CUDA_SANITIZER=1; any race report fails it.
        First a race planted in a thread of its own, which the sanitizer must report (else
        it fails too). Without CUDA the requests run unsanitized (the sanitizer needs CUDA)."""
        if self.deadline - time.monotonic() < 5:
            return {"ok": False, "error": "skipped: the check ran out of time"}
        env = {"TORCH_CUDA_SANITIZER": "1"} if cuda else None
        caught = None
        if cuda:
            planted = self.start("planted", env=env)
            self.finish(planted, min(30.0, limit_s / 3))
            caught = any("CSAN detected" in line for line in planted.flagged)
        child = self.start("sanitized", env=env)
        result = self.finish(child, limit_s)
        races = [line for line in child.flagged if "CSAN detected" in line]
        result["race_reports"] = len(races)
        result["report_head"] = child.flagged[:10]
        result["planted_race_caught"] = caught
        if not cuda:
            return {**result, "ok": None, "skipped": "no cuda", "requests_ok": result.get("ok")}
        tracked = bool(result.get("threads_tracked"))
        result["ok"] = bool(result.get("ok")) and not races and tracked and bool(caught)
        return result

    def cuda_tests(self, limit_s: float, cuda: bool) -> Json:
        """`pytest -m cuda` over the test files that use the marker (without CUDA they skip
        themselves: that still runs the plumbing)."""
        import importlib.util

        if importlib.util.find_spec("pytest") is None:
            return {"ok": False, "error": f"pytest is not installed for {sys.executable}"}
        if self.deadline - time.monotonic() < 5:
            return {"ok": False, "error": "skipped: the check ran out of time"}
        tests = sorted((ROOT / "tests").glob("test_*.py"))
        files = [str(p.relative_to(ROOT)) for p in tests if "mark.cuda" in p.read_text()]
        # pytest under the checkout's bootstrap: `tandem` is this checkout, installed or not
        boot = (
            f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); "
            "from checkout import use_checkout; use_checkout(); import pytest; "
            "sys.exit(pytest.main(sys.argv[1:]))"
        )
        argv = [sys.executable, "-c", boot, "-q", "-m", "cuda", "-p", "no:cacheprovider"]
        child = self.start("cuda_tests", argv=argv + files)
        result = child.wait(min(child.started + limit_s, self.deadline))
        lines = [line for line in child.stdout if line.strip()]
        counts = re.compile(r"\d+ (passed|failed|errors?|skipped|deselected)")
        summary = next((line for line in reversed(lines) if counts.search(line)), None)
        out = {
            "files": files,
            "summary": summary,
            "problems": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20],
            "rc": child.proc.returncode,
            "wall_s": round(time.monotonic() - child.started, 2),
        }
        if str(result.get("error")).startswith("timed out"):
            out["error"] = result["error"]
        passed = child.proc.returncode == 0 and "passed" in (summary or "")
        say(f"gpu-check: cuda_tests {summary}")
        if not cuda:
            return {
                **out,
                "ok": None,
                "skipped": "no cuda",
                "tests_ran": child.proc.returncode == 0,
            }
        return {**out, "ok": passed}
