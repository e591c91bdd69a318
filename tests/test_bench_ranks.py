"""`tandem bench prefill --ranks 2` (issue 52): the prompt through this process's device and
through two ranks under torch's launcher (gloo on the CPU), in turns; where the link binds,
each rank streams half of every layer over its own link, so its pass takes about half as long."""

from __future__ import annotations

import json
import socket
import sys
import tempfile

import pytest
from tandem.nodes.model import load_index
from tandem.nodes.prefill.measure.bench import main
from tandem.nodes.prefill.measure.bench_ranks import LaunchedRanks

from tests.conftest import MakeTiny

TOKENS = 40
HIDDEN = 64  # the made model's (MakeModelArgs' default)


def test_two_ranks_stream_half_and_take_half_as_long_where_the_link_binds(
    tiny_model: MakeTiny, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tiny_model(arch="llama", layers=4, intermediate=256)
    index = load_index(path)
    quarter = sum(index.layer_bytes(i) for i in range(4)) // 4  # no layer stays resident
    # ~1 MB a pass at 16 Mbit/s: 0.5 s on one device's link, 0.25 s on each rank's
    argv = ["--model", str(path), "--tokens", str(TOKENS), "--budget", str(quarter),
            "--link-gbps", "0.016", "--repeat", "1", "--ranks", "2", "--json"]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ranks"] == 2 and r["ranks_backend"] == "gloo"
    assert r["ranks_resident_layers"] == [[], []]
    first, second = r["ranks_bytes_streamed"]
    assert first == second
    assert abs(first - r["bytes_streamed"] / 2) <= 0.01 * r["bytes_streamed"]  # norms: on both
    # two all-reduces a layer (after the attention, after the MLP), each [T, H] in float32
    assert r["ranks_reduced_bytes_per_layer"] == [2 * TOKENS * HIDDEN * 4] * 2
    assert all(s > 0 for s in r["ranks_pass_s"])
    assert r["ranks_wall_s"] < r["one_device_wall_s"]
    assert r["ranks_ratio"] < 0.75  # ≈ 0.5; this machine is shared


def test_a_rank_that_fails_says_so_with_its_output() -> None:
    cmd = [sys.executable, "-c", "print('rank 1: out of memory'); raise SystemExit(3)"]
    with tempfile.TemporaryFile("w+b") as log, socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.1)
        with pytest.raises(RuntimeError, match=r"(?s)exit 3.*rank 1: out of memory"):
            LaunchedRanks(cmd, {}, server, log)
