"""The `ranks` section (issue 52): a prefill node of two ranks, each its share of every layer,
against one device's handovers, on this machine's card.

Both ranks share the one card (cuda:0) and sum over gloo (NCCL takes one rank per card; two
cards would run it with NCCL): what a GPU shows that the CPU tests cannot is the ranked engine
on CUDA tensors: o_proj's and down_proj's columns read by strided copies into pinned staging
and through the CUDA mover, the all-reduce of a branch's share on the compute stream, a
layer's K/V summed into rank 0 and handed over from its side stream. A Llama, a routed
Qwen3-MoE, a Qwen3.5 (its linear layers' states) and a 4-bit Llama (packed columns), float32,
at a quarter of their layers' bytes (half for the 4-bit one), a prompt and a second turn
after its prefix; every layer within 1e-4 of one device's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .context import Ctx, say
from .sizes import Json

ROOT = Path(__file__).resolve().parents[2]
SHAPES: dict[str, Json] = {
    "llama": {"arch": "llama", "intermediate": 256},
    "qwen3_moe": {"arch": "qwen3_moe", "experts": 8, "top_k": 2, "intermediate": 256},
    "qwen3_5": {"arch": "qwen3_5", "intermediate": 256},
    "llama-4bit": {"arch": "llama", "hidden": 256, "intermediate": 512, "quantize": 4},
}
ATOL = 1e-4  # float32 on both sides; the ranks add their shares in another order


def _made(ctx: Ctx, name: str) -> Path:
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    out = ctx.work / f"ranks-{name}"
    if not out.is_dir():
        make_model(out, MakeModelArgs(layers=4, **SHAPES[name]))  # type: ignore[arg-type]
    return out


def _budget(path: Path) -> int:
    from tandem.nodes.model.index import load_index

    index = load_index(path)
    layers = sum(index.layer_bytes(i) for i in range(index.spec.num_layers))
    return layers // (2 if index.quantized else 4)


def ranks_section(ctx: Ctx) -> Json:
    import torch

    if not ctx.cuda:
        return {"skipped": "needs CUDA"}
    models = {name: _made(ctx, name) for name in SHAPES}
    specs = [f"{path}:{_budget(path)}:{int(name.startswith('llama'))}"
             for name, path in models.items()]  # fmt: skip
    out = ctx.work / "ranks-out"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "RANKS_DEVICE": "cuda:0", "RANKS_BACKEND": "gloo",
           "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "ranks_run.py"), str(out), *specs]  # fmt: skip
    say("ranks: two ranks on cuda:0 (gloo)")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=240)
    if done.returncode:
        tail = (done.stdout + done.stderr).decode(errors="replace").splitlines()[-12:]
        return {"ok": False, "error": f"the ranks exited with {done.returncode}", "tail": tail}
    saved = torch.load(out / "ranks.pt")
    result: Json = {"ok": True}
    for name, path in models.items():
        runs = saved[str(path)]
        result[name] = one = _against_one_device(path, runs)
        result["ok"] = result["ok"] and one["ok"]
    return result


def _against_one_device(path: Path, runs: dict[str, Any]) -> Json:
    from tandem.nodes.prefill.engine import PrefillEngine

    sys.path.insert(0, str(ROOT / "tests"))
    from ranks_run import PROMPT, SPLIT, _tensors  # the runner's own prompt and split

    engine = PrefillEngine(path, budget=_budget(path), device="cuda", chunk_tokens=8)
    try:
        want = [_tensors(item) for item in engine.prefill(PROMPT)]
        errs = {"whole": _max_abs(runs["whole"], want)}
        if "second" in runs:
            kv = [(t["k"][:, :, :SPLIT], t["v"][:, :, :SPLIT]) for t in want]
            turn = [_tensors(item) for item in engine.prefill(PROMPT[SPLIT:], start=SPLIT,
                                                                prefix=kv)]  # fmt: skip
            errs["second"] = _max_abs(runs["second"], turn)
    finally:
        engine.close()
    records = runs["records"]
    return {
        "max_abs": errs,
        "ok": all(e <= ATOL for e in errs.values()),
        "bytes_per_rank": [r["bytes_streamed"] for r in records],
        "reduced_bytes_per_rank": [r["reduced_bytes"] for r in records],
        "pass_s_per_rank": [round(r["seconds"], 4) for r in records],
    }


def _max_abs(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> float:
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        for name in b:
            if name not in a or a[name].shape != b[name].shape:
                return float("inf")
            worst = max(worst, (a[name].float() - b[name].float().cpu()).abs().max().item())
    return worst
