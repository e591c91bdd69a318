"""`tandem tui` arguments: peers, the token (file or TANDEM_TOKEN), mDNS on by default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tandem.app.cli.errors import UsageError
from tandem.app.tui import command


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_tui_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["tui", *argv])


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple]:
    calls: list[tuple] = []
    monkeypatch.setattr(command, "run_tui", lambda *a, **kw: calls.append((a, kw)) or 0)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("TANDEM_TOKEN", raising=False)
    return calls


def test_peers_and_token_file_reach_the_dashboard(launched: list[tuple], tmp_path: Path) -> None:
    (tmp_path / "t").write_text("s3cret\n")
    a = _parse("--peer", "http://10.0.0.2:8470", "--peer", "mac:8470", "--token-file",
               str(tmp_path / "t"))  # fmt: skip
    assert a.func(a) == 0
    assert launched == [((["http://10.0.0.2:8470", "mac:8470"], "s3cret"), {"mdns": True})]


def test_token_from_the_environment_and_no_mdns(
    launched: list[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_TOKEN", "from-env")
    a = _parse("--peer", "127.0.0.1:8470", "--no-mdns")
    a.func(a)
    assert launched == [((["127.0.0.1:8470"], "from-env"), {"mdns": False})]


def test_nothing_to_watch_or_a_bad_token_file_is_a_usage_error(
    launched: list[tuple], tmp_path: Path
) -> None:
    with pytest.raises(UsageError, match="--peer"):
        a = _parse("--no-mdns")
        a.func(a)
    with pytest.raises(UsageError, match="token file"):
        a = _parse("--token-file", str(tmp_path / "missing"))
        a.func(a)
    assert launched == []


def test_python_dash_m_prints_a_usage_error_in_one_line() -> None:
    """`python -m tandem.app` runs the CLI through `__main__`; the subcommands import
    `tandem.app.cli.errors`. The error they raise must still be the one caught: one line and
    status 2, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "tandem.app", "tui", "--no-mdns"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60,
        env={**os.environ, "TANDEM_TOKEN": ""}, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "tandem tui: give a node with --peer URL, or allow mDNS discovery"
    ]
