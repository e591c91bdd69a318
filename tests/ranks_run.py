"""Run under `torchrun --nproc-per-node N` by the ranks tests: each model's prompts prefilled by
N ranks of one node (rank 0 saves every layer's handover and the ranks' records).

    ranks_run.py OUT MODEL:BUDGET:PREFIX ...   (PREFIX: 1 to prefill a second turn after a
                                                cached prefix of the first)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    import tandem.nodes  # noqa: F401
except ModuleNotFoundError:  # gpu-check's `ranks` on a bare box: this checkout, uninstalled
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from checkout import use_checkout

    use_checkout()

import torch
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import LayerKV
from tandem.nodes.prefill.ranks.collective import Collective, world_from_env
from tandem.nodes.prefill.ranks.follower import follow

PROMPT = [(7 * i + 3) % 500 for i in range(41)]
SPLIT = 25  # the second turn: positions 25.. after the first 25's K/V


def _tensors(item: object) -> dict[str, torch.Tensor]:
    if isinstance(item, LayerKV):
        return {"k": item.k.cpu().clone(), "v": item.v.cpu().clone()}
    return {n: t.cpu().clone() for n, t in item.tensors.items()}  # type: ignore[attr-defined]


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO)
    out, *models = sys.argv[1:]
    world = world_from_env()
    assert world is not None
    rank, size, _ = world
    # RANKS_DEVICE/RANKS_BACKEND: gpu-check's two ranks on one card (gloo: NCCL takes one
    # rank per card)
    device = os.environ.get("RANKS_DEVICE", "cpu")
    c = Collective.start(rank, size, torch.device(device), os.environ.get("RANKS_BACKEND"))
    saved: dict[str, object] = {}
    for spec in models:
        path, budget, prefix = spec.rsplit(":", 2)
        engine = PrefillEngine(path, budget=int(budget), device=device, chunk_tokens=8,
                               collective=c)  # fmt: skip
        engine.route_experts = "always"
        if rank == 0:
            whole = [_tensors(item) for item in engine.prefill(PROMPT)]
            runs = {"whole": whole, "records": [vars(r) for r in c.records]}
            if prefix == "1":
                kv = [(t["k"][:, :, :SPLIT], t["v"][:, :, :SPLIT]) for t in whole]
                turn = engine.prefill(PROMPT[SPLIT:], start=SPLIT, prefix=kv)
                runs["second"] = [_tensors(item) for item in turn]
            runs["plan"] = {"streamed": engine.plan.streamed_bytes,
                            "resident": list(engine.plan.resident_layers)}  # fmt: skip
            saved[path] = runs
        else:
            follow(engine)
        engine.close()  # (rank 0: the others' `follow` returns)
    if rank == 0:
        torch.save(saved, os.path.join(out, "ranks.pt"))
    c.close()


if __name__ == "__main__":
    main()
