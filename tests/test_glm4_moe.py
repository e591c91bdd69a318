"""GLM-4.x MoE (`glm4_moe`) on the prefill engine against mlx-lm's own prefill, the oracle: RoPE
on half of each head, q/k/v biases, a dense first layer, the noaux_tc router (sigmoid scores,
a correction bias, expert groups), a shared expert and routed experts stacked, one by one (with
Hugging Face's multi-token-prediction layer, skipped) and 4-bit; at a budget that holds the
model, a quarter of it and one below a layer's experts; after a prefix; mlx-lm's greedy
continuation from our K/V; only the routed experts streamed for a short prompt. Made float32
models (mlx-lm's own `glm4_moe` class), all on CPU."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.spec import MoeSpec, load_spec
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.kernels.noaux_router import noaux_select

from tests.conftest import MakeTiny
from tests.test_gemma3_prefill import mlx_prefill
from tests.test_prefill_engine import greedy

LAYOUTS = ("stacked", "per-expert", "stacked-4bit")
N = 24  # prompt tokens
STEPS = 6


def glm4_args(layout: str, **extra: object) -> dict[str, object]:
    """4 layers (layer 0 dense), 8 experts top-2 and a shared one, head_dim 16 with RoPE on 8
    dims. "stacked": 4 groups of 2 experts, the best 2 groups kept, q/k norms, a routed scaling
    of 2.5; "per-expert": Hugging Face's names and MTP layer, one group, no q/k norms;
    "stacked-4bit": mlx-lm's converter at 4 bits (a dense width of 128: whole groups)."""
    own: dict[str, object] = {"n_group": 4, "topk_group": 2, "qk_norm": True,
                              "routed_scaling": 2.5}  # fmt: skip
    if layout == "per-expert":
        own = {}
    if layout.endswith("-4bit"):
        own.update(quantize=4, intermediate=128)
    return {"arch": "glm4_moe", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2,
            "head_dim": 16, "experts": 8, "top_k": 2, "moe_intermediate": 64,
            "expert_layout": layout.removesuffix("-4bit"), **own, **extra}  # fmt: skip


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng([n, seed]).integers(0, 500, n).tolist()


def experts_bytes(index: ModelIndex, layer: int) -> int:
    tensors = index.layers[layer].items()
    return sum(e.nbytes for k, e in tensors if k.startswith(("mlp.experts.", "mlp.switch_mlp.")))


BUDGETS: dict[str, Callable[[ModelIndex], int | None]] = {
    "whole": lambda index: None,
    "quarter": lambda index: sum(index.layer_bytes(i) for i in range(4)) // 4,
    "below_experts": lambda index: experts_bytes(index, 1) * 2 // 3,
}


@pytest.fixture(scope="module", params=LAYOUTS)
def glm4_dir(request: pytest.FixtureRequest, tiny_model: MakeTiny) -> Path:
    return tiny_model(**glm4_args(request.param))


@pytest.fixture(scope="module")
def mlx_model(glm4_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(glm4_dir))[0]


def assert_matches(kv: Sequence[Any], cache: list[Any], start: int = 0) -> None:
    """Our K/V equal mlx-lm's of positions start.. in every layer."""
    for layer, c in zip(kv, cache, strict=True):
        for ours, theirs in ((layer.k, c.keys), (layer.v, c.values)):
            held = np.array(theirs[..., start : c.offset, :])
            np.testing.assert_allclose(
                ours.numpy(), held, rtol=0, atol=1e-4, err_msg=f"layer {layer.layer}"
            )


def test_spec(tiny_model: MakeTiny) -> None:
    spec = load_spec(tiny_model(**glm4_args("stacked")))
    assert spec.family == "glm4_moe" and spec.head_dim == 16 and spec.partial_rotary_factor == 0.5
    assert spec.attention_bias and spec.qk_norm and spec.rope_scaling is None
    assert spec.moe == MoeSpec(
        8, 2, 64, True, (False, True, True, True), shared_intermediate_size=64,
        scoring="sigmoid", groups=4, topk_groups=2, routed_scaling=2.5,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "refused"),
    [({"topk_method": "greedy"}, "topk_method"), ({"scoring_func": "softmax"}, "softmax"),
     ({"tie_word_embeddings": True}, "lm_head"), ({"n_group": 3}, "n_group"),
     ({"partial_rotary_factor": None}, "partial_rotary_factor")],
)  # fmt: skip
def test_what_mlx_lm_would_run_otherwise_is_refused(
    change: dict[str, object], refused: str, tiny_model: MakeTiny, tmp_path: Path
) -> None:
    config = json.loads((tiny_model(**glm4_args("stacked")) / "config.json").read_text())
    config.update(change)
    if change == {"partial_rotary_factor": None}:
        del config["partial_rotary_factor"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=refused):
        load_spec(tmp_path)


def test_rope_scaling_is_ignored_as_mlx_lm_does(tiny_model: MakeTiny, tmp_path: Path) -> None:
    config = json.loads((tiny_model(**glm4_args("stacked")) / "config.json").read_text())
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_spec(tmp_path).rope_scaling is None


@pytest.mark.parametrize(("groups", "topk_groups", "k"), [(1, 1, 3), (4, 2, 3), (8, 3, 5)])
def test_the_router_chooses_as_mlx_lm(groups: int, topk_groups: int, k: int) -> None:
    """Many tokens, the correction bias of both signs. (Where a token's kept groups hold
    fewer than k positive biased scores, zeroed experts tie for the rest: which of them mlx-lm
    takes is its argpartition's choice. No token here comes near.)"""
    import mlx.core as mx
    from mlx_lm.models.glm4_moe import group_expert_select

    rng = np.random.default_rng(groups)
    logits = rng.standard_normal((64, 16)).astype(np.float32) * 2
    bias = rng.standard_normal(16).astype(np.float32) * 0.1
    moe = MoeSpec(16, k, 8, True, (True,), scoring="sigmoid", groups=groups,
                  topk_groups=topk_groups, routed_scaling=2.5)  # fmt: skip
    experts, weights = noaux_select(torch.from_numpy(logits), torch.from_numpy(bias), moe)
    inds, scores = group_expert_select(mx.array(logits), mx.array(bias), k, groups, topk_groups,
                                       2.5, True)  # fmt: skip
    inds, scores = np.array(inds), np.array(scores)
    for t in range(64):
        ours = dict(zip(experts[t].tolist(), weights[t].tolist(), strict=True))
        theirs = dict(zip(inds[t].tolist(), scores[t].tolist(), strict=True))
        assert ours.keys() == theirs.keys(), t
        np.testing.assert_allclose([ours[e] for e in theirs], list(theirs.values()), rtol=1e-6)


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_matches_mlx_lm(
    budget: str, glm4_dir: Path, mlx_model: Any, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    index = load_index(glm4_dir)
    engine = cpu_engine(glm4_dir, budget=BUDGETS[budget](index))
    loads = [[part.op for part in ld.parts] for ld in engine.plan.loads if ld.layer == 1]
    if budget == "below_experts":  # a routed layer's experts come in more than one load
        assert sum(ops == ["experts"] * len(ops) for ops in loads) > 1
    if budget != "whole":
        assert not all(ld.resident for ld in engine.plan.loads)
        assert any("shared" in ops for ops in loads)
    tokens = prompt(N)
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(mlx_model, tokens))


def test_after_a_prefix(
    glm4_dir: Path, mlx_model: Any, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    tokens, k = prompt(N), 9
    engine = cpu_engine(glm4_dir, budget=BUDGETS["quarter"](load_index(glm4_dir)))
    prefix = [(layer.k, layer.v) for layer in engine.prefill(tokens[:k])]
    rest = list(engine.prefill(tokens[k:], start=k, prefix=prefix))
    assert_matches(rest, mlx_prefill(mlx_model, tokens[:k], tokens[k:]), start=k)


def test_decode_continues_from_our_kv(
    glm4_dir: Path, mlx_model: Any, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = prompt(N)
    engine = cpu_engine(glm4_dir, budget=BUDGETS["below_experts"](load_index(glm4_dir)))
    caches = make_prompt_cache(mlx_model)
    for layer, cache in zip(engine.prefill(tokens[:-1]), caches, strict=True):
        cache.update_and_fetch(mx.array(layer.k.numpy()), mx.array(layer.v.numpy()))
    assert greedy(mlx_model, tokens[-1:], caches, STEPS) == greedy(mlx_model, tokens, None, STEPS)


def mlx_choices(model: Any, tokens: list[int]) -> dict[int, set[int]]:
    """Per routed layer, the experts mlx-lm's own router chose for any of `tokens`."""
    import mlx.core as mx

    seen: dict[int, Any] = {}

    class Recording:
        def __init__(self, i: int, gate: Any) -> None:
            self.i, self.gate = i, gate

        def __call__(self, x: Any) -> Any:
            seen[self.i] = out = self.gate(x)
            return out

    routed = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "switch_mlp")]
    for i in routed:
        model.model.layers[i].mlp.gate = Recording(i, model.model.layers[i].mlp.gate)
    try:
        model(mx.array([tokens]))
    finally:
        for i in routed:
            model.model.layers[i].mlp.gate = model.model.layers[i].mlp.gate.gate
    return {i: set(np.array(inds).flatten().tolist()) for i, (inds, _) in seen.items()}


def test_a_short_prompt_streams_exactly_the_routed_experts(
    tiny_model: MakeTiny, cpu_engine: Callable[..., PrefillEngine]
) -> None:
    import mlx_lm

    biased = tiny_model(**glm4_args("stacked"), router_bias=2.0)
    model = mlx_lm.load(str(biased))[0]
    index = load_index(biased)
    # a slow link (1.25 MB/s): the experts left unread save more than the routers cost
    engine = cpu_engine(biased, budget=BUDGETS["quarter"](index), link_gbps=0.01)
    engine.route_experts = "always"
    all_bytes = engine.stream_weights().bytes_streamed
    tokens = prompt(3, seed=3)
    assert_matches(list(engine.prefill(tokens)), mlx_prefill(model, tokens))
    used = {i: len(chosen) for i, chosen in mlx_choices(model, tokens).items()}
    assert engine.last_stats.experts_streamed == used and max(used.values()) < 8
    assert engine.last_stats.bytes_streamed < all_bytes


def test_the_multi_token_prediction_layer_is_skipped(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """Hugging Face's checkpoint holds layer 4 (num_hidden_layers) too: mlx-lm drops it, and
    so does the index; a family without one still refuses a layer past the last."""
    from tandem.nodes.model.safetensors_format import read_header

    model = tiny_model(**glm4_args("per-expert"))
    with open(model / "model.safetensors", "rb") as f:
        headers = read_header(f)[0]
    mtp = [h.end - h.begin for n, h in headers.items() if n.startswith("model.layers.4.")]
    assert "model.layers.4.eh_proj.weight" in headers and len(mtp) > 30
    index = load_index(model)
    assert len(index.layers) == 4 and index.expert_layout(1) == "per-expert"
    assert index.total_bytes == sum(h.end - h.begin for h in headers.values()) - sum(mtp)
    qwen = tiny_model(arch="qwen3_moe", layers=2)
    config = json.loads((qwen / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    (tmp_path / "model.safetensors").symlink_to(qwen / "model.safetensors")
    with pytest.raises(ModelError, match="beyond num_hidden_layers"):
        load_index(tmp_path)
