"""One GPU check for the CUDA prefill (issue 17), as one JSON report in under five minutes.

The sections run in order, each in a child process (`runner`); `--section NAME` is such a
child (`child`)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from .child import SECTIONS, child_main
from .report import emit, summarize
from .runner import Runner
from .sizes import Json

TIME_LIMIT_S = 290.0
SKIPPED_NO_CUDA: dict[str, object] = {"ok": None, "skipped": "no cuda"}
NEEDS_CUDA: dict[str, object] = {"ok": None, "skipped": "needs CUDA"}


def check(smoke: bool, time_limit: float, work_dir: str | None) -> int:
    t0 = time.monotonic()
    deadline = t0 + time_limit
    sections: Json = {}
    report: Json = {
        "check": "tandem scripts/gpu-check",
        "smoke": smoke,
        "cuda": False,
        "time_limit_s": time_limit,
        "sections": sections,
    }
    run = Runner(smoke, deadline)
    sections["env"] = run.section("env", 60)
    cuda = bool(sections["env"].get("cuda")) and not smoke
    report["cuda"] = bool(sections["env"].get("cuda"))
    if not report["cuda"] and not smoke:
        failed = sections["env"].get("ok") is False
        report["note"] = (
            "the env section failed: CUDA unknown"
            if failed
            else "no CUDA device here: nothing to check (--cpu-smoke runs it on the CPU)"
        )
        report["wall_s"] = round(time.monotonic() - t0, 2)
        emit(report)
        return 1 if failed else 0
    run.work = Path(tempfile.mkdtemp(prefix="tandem-gpu-check-", dir=work_dir))
    try:
        run_all(run, sections, cuda)
    except Exception as e:  # a bug in the driver itself: still report what ran
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        run.close()
        shutil.rmtree(run.work, ignore_errors=True)
    report["summary"] = summarize(sections, smoke)
    report["wall_s"] = round(time.monotonic() - t0, 2)
    emit(report)
    return 1 if report["summary"]["failed"] or "error" in report else 0


def run_all(run: Runner, sections: Json, cuda: bool) -> None:
    """The sections in order; the big models are written, and the quantized model checked,
    while the small ones run. Each has a
    time limit of its own; all of them end by the check's deadline. The disk-heavy ones are
    capped too: the model writes (the wide one skipped on a slow disk) and the bench's cold
    pass (COLD_CAP_BYTES)."""
    sections["h2d"] = run.section("h2d", 60) if cuda else SKIPPED_NO_CUDA
    build = run.start("model")
    quantized = run.start("quantized")  # beside the others: it compares, it does not time
    sections["attention"] = run.section("attention", 60)
    sections["kv"] = run.section("kv", 90)
    sections["requests"] = run.section("requests", 60)
    sections["quantized"] = run.finish(quantized, 150)
    sections["race"] = run.section("race", 45) if cuda else NEEDS_CUDA
    sections["model"] = run.finish(build, 150)
    # issue 17's and 34's bounds first (the bench, the reserve), should time run short
    sections["bench"] = run.section("bench", 100)
    sections["memory"] = run.section("memory", 60)
    sections["families"] = run.section("families", 90)  # issue 48: every family, the experts
    sections["dequant"] = run.section("dequant", 45)  # the Triton kernel compiles 4 times
    sections["host"] = run.section("host", 60)  # the RAM tier at 70B's width, RSS, per op
    sections["ranks"] = run.section("ranks", 120) if cuda else NEEDS_CUDA  # issue 52
    sections["small_card"] = run.section("small_card", 60)
    sections["sanitizer"] = run.sanitizer(90, cuda)
    sections["cuda_tests"] = run.cuda_tests(120, cuda)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="run what can run on the CPU, tiny")
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds, all in all")
    p.add_argument("--work-dir", default=None, help="where the check's models go (default: TMPDIR)")
    p.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.section:
        return child_main(a.section, a.cpu_smoke, a.work or Path(tempfile.gettempdir()))
    return check(a.cpu_smoke, a.time_limit, a.work_dir)
