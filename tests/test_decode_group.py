"""A decode group (issue 38): a model's layers split by pipeline across `mx.distributed`
ranks that `mlx.launch` starts (ring backend, on loopback here), each loading only its own.
Greedy tokens equal single-process mlx-lm's; each rank's weights are its share; a rank that
exits takes the group down (what `mlx.launch` does)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tandem.nodes.decode.group.split import ranges, split_layers
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.group_support import LAUNCH, ring_port


def test_layers_split_by_memory_contiguously_rank_0_last() -> None:
    assert split_layers(4, [1, 1]) == [2, 2]
    assert split_layers(8, [3 * 2**30, 2**30]) == [6, 2]
    assert split_layers(5, [1, 1]) == [3, 2]  # the remainder to the lower rank, as mlx-lm
    assert split_layers(3, [100, 1, 1]) == [1, 1, 1]  # one layer each, at least
    assert ranges([3, 1]) == [(1, 4), (0, 1)]
    with pytest.raises(ValueError, match="3 ranks cannot share 2 layers"):
        split_layers(2, [1, 1, 1])
    with pytest.raises(ValueError, match="every rank needs memory"):
        split_layers(4, [1, 0])


def launch(*command: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`mlx.launch -n 2 --backend ring` on loopback, from a free port."""
    args = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(ring_port()),
            "--", sys.executable, *command]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def reference(model: Path, prompt_tokens: int, tokens: int) -> list[int]:
    """Single-process mlx-lm's greedy tokens for the bench's prompt."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from tandem.nodes.decode.group.bench import bench_prompt

    m, _ = mlx_lm.load(str(model))
    prompt = mx.array(bench_prompt(m, prompt_tokens))
    steps = generate_step(prompt, m, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize(
    "arch",
    ["llama", "qwen3_5"],  # our stages; mlx-lm's own pipeline()
)
def test_two_ranks_decode_as_one_process_each_loading_its_share(
    arch: str, tiny_model: MakeTiny
) -> None:
    model = tiny_model(arch=arch, layers=4)
    run = launch("-m", "tandem.app", "bench", "group", str(model), "--json",
                 "--prompt-tokens", "12", "--tokens", "8")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    assert report["size"] == 2
    assert report["tokens"] == reference(model, 12, 8)
    index = load_index(model)
    shared = sum(e.nbytes for e in index.globals.values())  # embedding, norm, head: each rank's
    spans = {r["rank"]: tuple(r["layers"]) for r in report["ranks"]}
    assert spans == {0: (2, 4), 1: (0, 2)}
    for r in report["ranks"]:
        first, end = r["layers"]
        own = sum(index.layer_bytes(i) for i in range(first, end))
        assert abs(r["weight_bytes"] - (shared + own)) <= 1024 + 0.01 * own  # KiB resolution
    assert report["step_bytes_sent"] == 3 * report["hidden_bytes"]  # one send, a gather of 2


def test_a_rank_that_exits_takes_the_group_down() -> None:
    """mlx.launch terminates the other ranks (SIGTERM) as soon as one exits: rank 0, waiting
    in a collective rank 1 never joins, does not outlive it."""
    t0 = time.monotonic()
    run = launch(str(Path(__file__).with_name("group_exit.py")), timeout=60)
    elapsed = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert "rank 0 met" in out and "rank 1 met" in out, out
    assert "exited with code 3" in out, out
    assert "outlived" not in out
    assert elapsed < 20, out
