"""DeepSeek V3 (`deepseek_v3`; Kimi K2's configs too) on the prefill engine against mlx-lm's own
prefill, the oracle: multi-head latent attention (the latent and the rope key per position, as
mlx-lm's cache holds them), YaRN RoPE on adjacent pairs, the noaux_tc router over two groups of
experts, a shared expert and a dense first layer; mlx-lm's saved layout and DeepSeek's; at a
budget that holds the model, a quarter of it and one below a layer's experts; after a prefix;
mlx-lm's greedy continuation from our latents; only the routed experts streamed for a short
prompt; a 4-bit build. Made float32 models (mlx-lm's own `deepseek_v3` class), all on CPU."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.spec import LayerKind, load_spec
from tandem.nodes.prefill.engine import PrefillEngine

from tests.conftest import MakeTiny
from tests.test_gemma3_prefill import mlx_prefill
from tests.test_glm4_moe import mlx_choices
from tests.test_prefill_engine import greedy

ARGS: dict[str, Any] = {
    "arch": "deepseek_v3", "layers": 3, "hidden": 64, "heads": 4, "experts": 8, "top_k": 2,
    "n_group": 2, "topk_group": 1, "first_dense": 1, "moe_intermediate": 64,
    "rope_scaling": "yarn",
}  # fmt: skip


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng([n, seed]).integers(0, 300, n).tolist()


def experts_bytes(index: ModelIndex, layer: int) -> int:
    return sum(e.nbytes for k, e in index.layers[layer].items() if "switch_mlp" in k
               or k.startswith("mlp.experts."))  # fmt: skip


BUDGETS: dict[str, Callable[[ModelIndex], int | None]] = {
    "whole": lambda index: None,
    "quarter": lambda index: sum(index.layer_bytes(i) for i in range(3)) // 4,
    "below_experts": lambda index: experts_bytes(index, 1) * 2 // 3,
}


@pytest.fixture(scope="module", params=["mlx", "hf"])
def model_dir(request: pytest.FixtureRequest, tiny_model: MakeTiny) -> Path:
    return tiny_model(**ARGS, layout=request.param)


def assert_matches(kv: Sequence[Any], cache: list[Any], start: int = 0) -> None:
    """Our latents (K) and rope keys (V) of positions start.. equal mlx-lm's cache's."""
    for layer, c in zip(kv, cache, strict=True):
        for ours, theirs in ((layer.k, c.keys), (layer.v, c.values)):
            want = np.array(theirs[..., start : c.offset, :])
            np.testing.assert_allclose(ours.numpy(), want, rtol=0, atol=1e-4,
                                       err_msg=f"layer {layer.layer}")  # fmt: skip


def test_spec_and_kimi_k2(model_dir: Path, tmp_path: Path) -> None:
    spec = load_spec(model_dir)
    assert spec.layer_kinds == (LayerKind("latent"),) * 3 and spec.float_kv
    assert spec.mla is not None and (spec.mla.kv_lora_rank, spec.mla.rope_dim) == (32, 16)
    assert spec.moe is not None and spec.moe.sparse == (False, True, True)
    assert (spec.moe.scoring, spec.moe.groups, spec.moe.topk_groups) == ("sigmoid", 2, 1)
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    assert load_spec(tmp_path).family == "deepseek_v3"  # as mlx-lm's MODEL_REMAPPING


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_matches_mlx_lm(
    budget: str, model_dir: Path, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    index = load_index(model_dir)
    engine = cpu_engine(model_dir, budget=BUDGETS[budget](index))
    if budget == "below_experts":  # a layer's experts come in more than one load
        loads = [ld for ld in engine.plan.loads if ld.layer == 1]
        assert sum(part.op == "experts" for ld in loads for part in ld.parts) > 1
    tokens = prompt(24)
    model = mlx_lm.load(str(model_dir))[0]
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(model, tokens))


def test_after_a_prefix_and_decode_from_our_latents(
    model_dir: Path, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model = mlx_lm.load(str(model_dir))[0]
    tokens, k = prompt(30), 11
    engine = cpu_engine(model_dir, budget=BUDGETS["quarter"](load_index(model_dir)))
    prefix = [(layer.k, layer.v) for layer in engine.prefill(tokens[:k])]
    rest = list(engine.prefill(tokens[k:], start=k, prefix=prefix))
    assert_matches(rest, mlx_prefill(model, tokens), start=k)
    caches = make_prompt_cache(model)
    for layer, cache in zip(engine.prefill(tokens[:-1]), caches, strict=True):
        cache.update_and_fetch(mx.array(layer.k.numpy()), mx.array(layer.v.numpy()))
    assert greedy(model, tokens[-1:], caches, 8) == greedy(model, tokens, None, 8)


def test_a_short_prompt_streams_exactly_the_routed_experts(
    tiny_model: MakeTiny, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    biased = tiny_model(**ARGS, router_bias=2.0)
    model = mlx_lm.load(str(biased))[0]
    engine = cpu_engine(biased, budget=BUDGETS["quarter"](load_index(biased)), link_gbps=0.01)
    engine.route_experts = "always"
    all_bytes = engine.stream_weights().bytes_streamed
    tokens = prompt(6, seed=3)
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(model, tokens))
    used = {i: len(chosen) for i, chosen in mlx_choices(model, tokens).items()}
    assert engine.last_stats.experts_streamed == used and max(used.values()) < 8
    assert engine.last_stats.bytes_streamed < all_bytes


def test_a_4bit_build_matches_mlx_lm(
    tiny_model: MakeTiny, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    q4 = tiny_model(**ARGS, quantize=4, group_size=32, intermediate=128, q_lora_rank=64)
    index = load_index(q4)
    assert index.quant(0, "self_attn.embed_q").bits == 4  # per head [heads, kv_lora, nope]
    tokens = prompt(20)
    engine = cpu_engine(q4, budget=sum(index.layer_bytes(i) for i in range(3)) // 2)
    assert not all(ld.resident for ld in engine.plan.loads)
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(mlx_lm.load(str(q4))[0], tokens))


def test_a_model_larger_than_the_ram_tier_reads_its_remainder_from_disk(
    tiny_model: MakeTiny, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    """VRAM → RAM → disk: the RAM tier holds a third of what a pass streams, the rest comes
    from disk every pass; a few tokens read only their routed experts, from either tier."""
    import mlx_lm

    biased = tiny_model(**ARGS, router_bias=2.0)
    index = load_index(biased)
    total = sum(index.layer_bytes(i) for i in range(3))
    engine = cpu_engine(biased, budget=total // 4, host_budget=total // 3, link_gbps=0.01)
    engine.route_experts = "always"
    engine.stream_weights()  # the first pass fills the RAM tier
    everything = engine.stream_weights()  # every expert: what the tiers split
    assert everything.disk_bytes > 0 and everything.ram_bytes > 0
    tokens = prompt(6, seed=3)
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(mlx_lm.load(str(biased))[0], tokens))
    stats = engine.last_stats
    assert stats.disk_bytes > 0 and stats.disk_bytes + stats.ram_bytes == stats.bytes_streamed
    assert stats.bytes_streamed < everything.bytes_streamed  # routed: only the chosen experts


def test_deepseek_v3_4bit_from_its_config_alone(tmp_path: Path) -> None:
    """mlx-community's DeepSeek-V3 4-bit as `tandem plan` sees it from config.json alone: its
    size (the files: 377 GB), and 576 values a position a layer on the wire in bf16."""
    import shutil

    from tandem.nodes.model.kv_bytes import kv_bytes
    from tandem.nodes.model.shapes_index import shapes_index

    shutil.copy(
        Path(__file__).parent / "configs" / "deepseek-v3-4bit.json", tmp_path / "config.json"
    )
    index = shapes_index(tmp_path)
    assert 351 << 30 < index.total_bytes < 353 << 30
    assert index.layers[5]["self_attn.embed_q.weight"].shape == (128, 512, 16)  # 128 · 4 / 32
    assert kv_bytes(index.spec, None, 2).at(1) == 61 * 576 * 2
