"""The engine under a mover that behaves as the CUDA one (issue 48 item 2): copies land late,
on a thread of their own, and a slot is poisoned (NaN) until its copy lands, so any read of a
slot before its copy event would show. Every family's K/V and state equal the plain CPU
mover's bit for bit, routed loads included (a routed load no token chose moves nothing: a
fresh CUDA engine's first such load crashed on its missing event)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import LayerKV
from tandem.nodes.prefill.stream.delayed import DelayedMover

from tests.conftest import MakeTiny

FAMILIES = {
    "llama": {"arch": "llama", "layers": 4},
    "gemma3": {"arch": "gemma3", "layers": 4},
    "qwen3_moe": {"arch": "qwen3_moe", "layers": 4, "experts": 16, "top_k": 2},
    "qwen3_5": {"arch": "qwen3_5", "layers": 4, "vocab": 320},
    "qwen3_5_moe": {"arch": "qwen3_5_moe", "layers": 4, "vocab": 320, "experts": 16,
                    "shared_intermediate": 32},
}  # fmt: skip


def _tensors(items: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, LayerKV):
            out += [item.k, item.v]
        else:
            out += [item.tensors[k] for k in sorted(item.tensors)]
    return out


def _late(files: list[str], device: torch.device, link_gbps: float | None) -> DelayedMover:
    return DelayedMover(files, device, link_gbps)


def _run(engine: PrefillEngine, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
    return [_tensors(list(engine.prefill(ids))) for ids in prompts]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_equals_the_plain_mover_with_copies_landing_late(
    name: str, tiny_model: MakeTiny
) -> None:
    index = load_index(tiny_model(**FAMILIES[name]))
    budget = sum(index.layer_bytes(i) for i in range(4)) // 4  # a ring, routed loads streamed
    vocab = index.spec.vocab_size
    # one token first: most routed loads move nothing (the fresh engine's hazard), then more
    prompts = [np.random.default_rng(n).integers(0, vocab, n).tolist() for n in (1, 2, 37)]
    late = PrefillEngine(index, budget=budget, device="cpu", chunk_tokens=16, host_budget=0,
                         mover=_late)  # fmt: skip
    plain = PrefillEngine(index, budget=budget, device="cpu", chunk_tokens=16, host_budget=0)
    try:
        for engine in (late, plain):
            engine.route_experts = "always"  # what the routers chose, whatever waiting costs
        got, want = _run(late, prompts), _run(plain, prompts)
        assert late.plan.n_slots >= 1 and any(not ld.resident for ld in late.plan.loads)
    finally:
        late.close()
        plain.close()
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_the_ram_tier_under_late_copies(tiny_model: MakeTiny) -> None:
    """The host tier's buffers are the copies' sources (no staging): still exact."""
    index = load_index(tiny_model(**FAMILIES["qwen3_moe"]))
    budget = sum(index.layer_bytes(i) for i in range(4)) // 4
    prompts = [np.random.default_rng(n).integers(0, 512, n).tolist() for n in (1, 9, 9)]
    late = PrefillEngine(index, budget=budget, device="cpu", host_budget=64 << 20, mover=_late)
    plain = PrefillEngine(index, budget=budget, device="cpu", host_budget=0)
    try:
        got, want = _run(late, prompts), _run(plain, prompts)
        assert late.plan.host_loads  # the tier holds loads
    finally:
        late.close()
        plain.close()
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_a_read_before_the_copy_lands_is_seen(tiny_model: MakeTiny) -> None:
    """The double can fail: a mover that does not wait for its copies gives NaN, not the
    plain mover's K/V."""

    class Careless(DelayedMover):
        def wait_ready(self, slot: int) -> None:
            return None

    index = load_index(tiny_model(**FAMILIES["llama"]))
    budget = sum(index.layer_bytes(i) for i in range(4)) // 4
    careless = PrefillEngine(index, budget=budget, device="cpu", host_budget=0,
                             mover=lambda files, device, link: Careless(files, device, link,
                                                                        delay_s=0.05))  # fmt: skip
    try:
        got = _run(careless, [list(range(1, 20))])[0]
    except Exception as e:  # the engine refuses non-finite K/V itself
        assert "finite" in str(e).lower() or "nan" in str(e).lower(), e
    else:
        assert not all(torch.isfinite(t).all() for t in got)
    finally:
        careless.close()
