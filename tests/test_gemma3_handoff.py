"""Gemma 3 (sliding-window layers) through real nodes : a remote prefill's
K/V fill mlx-lm's own mixed cache list (`RotatingKVCache` on sliding layers, `KVCache` on
global ones), and greedy tokens equal mlx-lm's own generation, for prompts longer than the
window (8 here: a short-window made model), with only each sliding layer's window on the wire."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.test_handoff import PROMPTS, Cluster, _chat, _cluster

WINDOW = 8


@pytest.fixture(scope="module")
def cluster(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tiny_model(arch="gemma3", layers=6, sliding_window=WINDOW, sliding_window_pattern=3)
    yield from _cluster(tmp_path_factory.mktemp("gemma3"), model)


def test_remote_chat_past_the_window_is_exactly_mlx_greedy(cluster: Cluster) -> None:
    for prompt in PROMPTS[:3]:
        n = len(cluster.chat_tokens(prompt))
        assert n > 2 * WINDOW
        reply = _chat(cluster.client(), prompt)
        extra = reply.model_extra["tandem"]
        assert extra["prefill"] == "remote", cluster.decode.output()
        assert extra["prefill_tokens"] == n - 1  # a new conversation: no cached prefix
        assert reply.choices[0].message.content == cluster.reference(prompt)
        # sliding layers send their window only: K and V in float32, plus each frame's header
        spec = load_index(cluster.model).spec
        per_position = 2 * spec.num_kv_heads * spec.head_dim * 4
        kept = [n - 1 if k.kind == "full" else WINDOW for k in spec.layer_kinds]
        assert 0 < extra["kv_bytes"] - per_position * sum(kept) < 1024 * spec.num_layers


def test_streamed_and_completions_equal_mlx(cluster: Cluster) -> None:
    from mlx_lm import generate

    prompt = PROMPTS[3]
    chunks = list(_chat(cluster.client(), prompt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].model_extra["tandem"]["prefill"] == "remote"
    assert text == cluster.reference(prompt)
    words = "The quick brown fox jumps over the lazy dog by the river bank"
    reply = cluster.client().completions.create(
        model="m", prompt=words, max_tokens=12, temperature=0
    )
    assert reply.model_extra["tandem"]["prefill"] == "remote"
    assert reply.choices[0].text == generate(
        cluster.mlx_model, cluster.tokenizer, words, max_tokens=12
    )


def test_quantized_kv_is_refused_for_windowed_layers(cluster: Cluster) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _chat(cluster.client(), PROMPTS[0], extra_body={"tandem": {"kv_bits": 8}})
    assert e.value.code == "unsupported_field"
    assert "sliding-window" in e.value.message
