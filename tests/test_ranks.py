"""Two ranks of one prefill node (issue 52), each its share of every layer, under torchrun with
gloo on the CPU: every layer's K/V (or state) equals the one-device prefill's, for every family
that splits, at a quarter budget; each rank holds and streams half of each layer's bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem.nodes.model import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.families import family_for
from tandem.nodes.prefill.planning.loads import slot_size
from tandem.nodes.prefill.ranks.shard import Shard, ShardedFamily

from tests.conftest import MakeTiny
from tests.ranks_run import PROMPT, SPLIT, _tensors

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # float32 made models; `prefix`: a second turn after the first's K/V too
    "llama": ({"arch": "llama", "layers": 4, "intermediate": 256}, True),
    "gemma3": ({"arch": "gemma3", "layers": 4, "intermediate": 256}, True),
    "qwen3_moe": ({"arch": "qwen3_moe", "layers": 4, "experts": 8, "top_k": 2,
                   "mlp_only_layers": (1,), "intermediate": 256}, False),
    "qwen3_5": ({"arch": "qwen3_5", "layers": 4, "intermediate": 256}, False),
    "qwen3_5_moe": ({"arch": "qwen3_5_moe", "layers": 4}, False),
    "gpt_oss": ({"arch": "gpt_oss", "layers": 4, "intermediate": 256}, True),
    "glm4_moe": ({"arch": "glm4_moe", "layers": 4, "intermediate": 256}, True),
    "deepseek_v3": ({"arch": "deepseek_v3", "layers": 4, "intermediate": 256}, True),
    # 4-bit: o_proj's and down_proj's columns as packed words and groups; Qwen3.5's q/k/v
    # ranges of one packed matrix
    "llama-4bit": ({"arch": "llama", "layers": 4, "hidden": 256, "intermediate": 512,
                    "quantize": 4}, True),
    "qwen3_5_moe-4bit": ({"arch": "qwen3_5_moe", "layers": 4, "hidden": 256, "quantize": 4,
                          "shared_intermediate": 128, "moe_intermediate": 128}, False),
}  # fmt: skip


def torchrun(nproc: int, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The command that starts `args` as `nproc` ranks on this machine (torch's own launcher),
    and the environment gloo needs on loopback."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *args]  # fmt: skip


def ranks_env() -> dict[str, str]:
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def quarter(path: Path) -> int:
    """A quarter of the layers' bytes; a half for a quantized model (a rank's share of an op
    is never cut further, and its matrices dequantize whole in float32 into the scratch)."""
    index = load_index(path)
    layers = sum(index.layer_bytes(i) for i in range(index.spec.num_layers))
    return layers // (2 if index.quantized else 4)


@pytest.fixture(scope="module")
def two_ranks(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every model's prompts prefilled once by two ranks (one torchrun for all of them)."""
    out = tmp_path_factory.mktemp("ranks")
    paths = {name: tiny_model(**kw) for name, (kw, _) in MODELS.items()}
    specs = [f"{paths[n]}:{quarter(paths[n])}:{int(MODELS[n][1])}" for n in MODELS]
    cmd = torchrun(2, str(ROOT / "tests" / "ranks_run.py"), str(out), *specs)
    done = subprocess.run(cmd, cwd=ROOT, env=ranks_env(), capture_output=True, timeout=300)
    (out / "log").write_bytes(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout.decode()[-4000:] + done.stderr.decode()[-4000:]
    saved = torch.load(out / "ranks.pt")
    return {name: (paths[name], saved[str(paths[name])]) for name in MODELS}


def _assert_close(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for layer, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), layer
        for name in a:
            assert a[name].shape == b[name].shape, (layer, name)
            err = (a[name].float() - b[name].float()).abs().max().item()
            assert err <= 1e-5, (layer, name, err)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_layer_equals_one_device(two_ranks: dict[str, Any], name: str) -> None:
    path, runs = two_ranks[name]
    engine = PrefillEngine(path, budget=quarter(path), device="cpu", chunk_tokens=8)
    try:
        want = [_tensors(item) for item in engine.prefill(PROMPT)]
        _assert_close(runs["whole"], want)
        if MODELS[name][1]:  # after a cached prefix: rank 0 sends it to rank 1
            kv = [(t["k"][:, :, :SPLIT], t["v"][:, :, :SPLIT]) for t in want]
            turn = engine.prefill(PROMPT[SPLIT:], start=SPLIT, prefix=kv)
            _assert_close(runs["second"], [_tensors(item) for item in turn])
    finally:
        engine.close()
    # both ranks streamed their share (the same, but for the experts their tokens chose),
    # and summed two branches a layer over the ranks
    first, second = runs["records"]
    if load_index(path).spec.moe is None:
        assert first["bytes_streamed"] == second["bytes_streamed"]
    assert first["bytes_streamed"] > 0 and second["bytes_streamed"] > 0
    assert first["reduced_bytes"] == second["reduced_bytes"] > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_holds_half_of_every_layer(tiny_model: MakeTiny, name: str) -> None:
    index = load_index(tiny_model(**MODELS[name][0]))
    family = family_for(index.spec.family)
    for layer in range(index.spec.num_layers):
        whole = slot_size(family.whole_layer(index, layer), False)
        shares = [
            slot_size(ShardedFamily(family, Shard(r, 2)).whole_layer(index, layer), False)
            for r in range(2)
        ]
        norms = whole * 0.06  # the norms and the router: on every rank
        assert all(abs(s - whole / 2) <= norms for s in shares), (layer, whole, shares)


def test_a_share_splits_evenly_in_units() -> None:
    assert [Shard(r, 2).range(256, 8) for r in range(2)] == [(0, 128), (128, 256)]
    assert [Shard(r, 3).range(8) for r in range(3)] == [(0, 3), (3, 5), (5, 8)]
    with pytest.raises(PrefillError, match="cannot be split over 2 ranks"):
        Shard(1, 2).range(1)


def test_columns_that_split_a_group_are_refused(tiny_model: MakeTiny) -> None:
    index = load_index(
        tiny_model(arch="llama", layers=2, intermediate=128, quantize=4)
    )  # hidden 64
    family = ShardedFamily(family_for(index.spec.family), Shard(0, 2))
    with pytest.raises(PrefillError, match=r"columns \(0, 32\) of self_attn.o_proj split"):
        family.whole_layer(index, 0)


def test_heads_fewer_than_the_ranks_are_refused(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(arch="llama", layers=2, heads=4, kv_heads=1))
    family = ShardedFamily(family_for(index.spec.family), Shard(1, 2))
    with pytest.raises(PrefillError, match="1 KV heads cannot be split over 2 ranks"):
        family.whole_layer(index, 0)


def test_health_says_each_rank_and_reads_it_back() -> None:
    from tandem.nodes.contract.cluster import Health
    from tandem.nodes.contract.http import ContractError
    from tandem.nodes.contract.ranks import PrefillRank, PrefillRanks, read_prefill_ranks

    ranks = PrefillRanks(2, "nccl", tuple(
        PrefillRank(r, f"cuda:{r}", 22 << 30, None, (0, 3), 63 << 30, 17 << 30, 46 << 30, 0,
                    pass_bytes=1 << 30, pass_reduced_bytes=1 << 20, pass_s=2.5,
                    pcie="Gen4 x8 (of Gen4 x16)")
        for r in range(2)
    ))  # fmt: skip
    body = {"prefill_ranks": ranks.to_json()}
    assert read_prefill_ranks(body, "/health") == ranks
    assert read_prefill_ranks({}, "/health") is None  # one device, or an older node
    health = Health("id", "n", ("prefill",), 5, "v", "cuda:0", 1, 2, "m", "fp", 4,
                    prefill_ranks=ranks)  # fmt: skip
    assert Health.from_json(health.to_json()) == health
    body["prefill_ranks"]["ranks"][1]["resident_layers"] = ["0"]
    with pytest.raises(ContractError, match="resident_layers"):
        read_prefill_ranks(body, "/health")
