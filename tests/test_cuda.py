"""The CUDA mover: pinned staging, a copy stream, events between copy and compute. These run
where a GPU is present and skip elsewhere; the CPU path (same streamer) is tested everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tandem.nodes.contract.events import LayerEvent
from tandem.nodes.model import ModelIndex, load_index
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning.budget import prompt_activations

from tests.records import listen

pytestmark = pytest.mark.cuda


def _kv(engine: PrefillEngine, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.k.float(), layer.v.float()) for layer in engine.prefill(tokens)]


def cuda_budget(index: ModelIndex, weights: int, tokens: int, chunk: int) -> int:
    """`weights` bytes for weights plus, as a CUDA engine reserves for prompts of `tokens`, room
    for their activations (all queries at once; a cut op's kept output included)."""
    itemsize = ITEMSIZE[index.dtype]
    return weights + prompt_activations(index.spec, tokens, 0, chunk, itemsize, "cuda", True)


@pytest.mark.parametrize("fraction", [0.25, "half-layer"])
def test_cuda_matches_cpu(tiny_model, fraction) -> None:
    model = tiny_model(arch="llama", layers=8, shards=2, rope_scaling="llama3")
    index = load_index(model)
    total = sum(index.layer_bytes(i) for i in range(index.spec.num_layers))
    weights = total // 4 if fraction == 0.25 else index.layer_bytes(0) // 2
    tokens = np.random.default_rng(1).integers(0, index.spec.vocab_size, 300).tolist()
    cpu = PrefillEngine(index, budget=weights, device="cpu", chunk_tokens=64)
    # the same room for weights; the CUDA engine reserves its activations on top
    budget = cuda_budget(index, weights, len(tokens), 64)
    gpu = PrefillEngine(
        index, budget=budget, device="cuda", chunk_tokens=64, max_prompt_tokens=len(tokens)
    )
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        for (kc, vc), (kg, vg) in zip(_kv(cpu, tokens), _kv(gpu, tokens), strict=True):
            assert torch.allclose(kc, kg, atol=1e-4) and torch.allclose(vc, vg, atol=1e-4)
        assert gpu.last_stats.peak_weight_bytes <= budget - gpu.activation_reserve
        assert gpu.plan.granularity == cpu.plan.granularity  # streamed the same way
    finally:
        cpu.close()
        gpu.close()


def test_a_prefix_goes_up_on_the_copy_stream_and_gives_the_same_kv(tiny_model) -> None:
    """After a prefix held in (pageable) host memory, each layer's prefix is pinned and copied
    on a side stream ahead of its compute (`PrefixUpload`): the same K/V as a pass over the
    whole prompt, on a budget that streams the layers."""
    model = tiny_model(arch="llama", layers=8)
    index = load_index(model)
    tokens = np.random.default_rng(2).integers(0, index.spec.vocab_size, 200).tolist()
    budget = cuda_budget(index, index.total_bytes // 4, len(tokens), 64)
    gpu = PrefillEngine(index, budget=budget, device="cuda", chunk_tokens=64,
                        max_prompt_tokens=len(tokens))  # fmt: skip
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        whole = [(layer.k.clone(), layer.v.clone()) for layer in gpu.prefill(tokens)]
        prefix = [(k[:, :, :120], v[:, :, :120]) for k, v in whole]
        later = list(gpu.prefill(tokens[120:], start=120, prefix=prefix))
        for (k, v), layer in zip(whole, later, strict=True):
            assert torch.allclose(k[:, :, 120:], layer.k, atol=1e-4)
            assert torch.allclose(v[:, :, 120:], layer.v, atol=1e-4)
    finally:
        gpu.close()


def test_cuda_overlap_and_memory(tiny_model) -> None:
    model = tiny_model(arch="qwen3", layers=8, shards=2, dtype="bfloat16")
    index = load_index(model)
    weights = sum(index.layer_bytes(i) for i in range(8)) // 4
    budget = cuda_budget(index, weights, 200, 512)
    engine = PrefillEngine(
        index, budget=budget, device="cuda", link_gbps=0.05, max_prompt_tokens=200
    )
    events: list[LayerEvent] = []
    listen(engine.events, lambda e: events.append(e) if isinstance(e, LayerEvent) else None)
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        list(engine.prefill(list(range(200))))
        assert torch.cuda.memory_allocated() - before < 16 * 1024 * 1024  # nothing leaks per pass
        streamed = [e for e in events if not e.pinned]
        loading = {e.layer: e.t for e in streamed if e.state == "loading"}
        evicted = {e.layer: e.t for e in streamed if e.state == "evicted"}
        overlapped = [i for i in loading if i - 1 in evicted and loading[i] < evicted[i - 1]]
        assert len(overlapped) >= len(loading) // 2
    finally:
        engine.close()
