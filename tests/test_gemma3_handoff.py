"""Gemma 3 (sliding-window layers) through real nodes : a remote prefill's
K/V fill mlx-lm's own mixed cache list (`RotatingKVCache` on sliding layers, `KVCache` on
global ones), and greedy tokens equal mlx-lm's own generation, for prompts longer than the
window (8 here: a short-window made model), with only each sliding layer's window on the wire;
quantized K/V on global layers; prompt caches across turns."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.handoff_checks import assert_completion_is_mlx
from tests.records import stats_of
from tests.test_handoff import PROMPTS, Cluster, _chat, _cluster

WINDOW = 8


@pytest.fixture(scope="module")
def cluster(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tiny_model(arch="gemma3", layers=6, sliding_window=WINDOW, sliding_window_pattern=3,
                       heads=2, kv_heads=1, head_dim=64)  # fmt: skip
    yield from _cluster(tmp_path_factory.mktemp("gemma3"), model)


def test_remote_chat_past_the_window_is_exactly_mlx_greedy(cluster: Cluster) -> None:
    for prompt in PROMPTS[:3]:
        n = len(cluster.chat_tokens(prompt))
        assert n > 2 * WINDOW
        reply = _chat(cluster.client(), prompt)
        stats = stats_of(reply)
        assert stats.prefill == "remote", cluster.decode.output()
        assert stats.prefill_tokens == n - 1  # a new conversation: no cached prefix
        assert reply.choices[0].message.content == cluster.reference(prompt)
        # sliding layers send their window only: K and V in float32, plus each frame's header
        spec = load_index(cluster.model).spec
        per_position = 2 * spec.num_kv_heads * spec.head_dim * 4
        kept = [n - 1 if k.kind == "full" else WINDOW for k in spec.layer_kinds]
        assert 0 < stats.kv_bytes - per_position * sum(kept) < 1024 * spec.num_layers


def test_streamed_and_completions_equal_mlx(cluster: Cluster) -> None:
    prompt = PROMPTS[3]
    chunks = list(_chat(cluster.client(), prompt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert stats_of(chunks[-1]).prefill == "remote"
    assert text == cluster.reference(prompt)
    assert_completion_is_mlx(cluster, 12)


def _ids(cluster: Cluster, prompt: list[int], bits: int = 0) -> list[int]:
    """mlx-lm's greedy token ids from scratch; with `bits`, over the mixed cache list made by
    hand (its global layers quantized after the prompt, its windows float)."""
    from tandem.nodes.contract.http import KVFormat
    from tandem.nodes.decode.reference import reference_tokens

    fmt = KVFormat(bits) if bits else None
    return list(reference_tokens(cluster.mlx_model, cluster.tokenizer, prompt, 6, kv_format=fmt))


def _complete(cluster: Cluster, prompt: list[int], bits: int = 0) -> tuple[str, ReplyStats]:
    extra = {"tandem": {"kv_bits": bits}} if bits else None
    reply = cluster.client().completions.create(
        model="m", prompt=prompt, max_tokens=6, temperature=0, extra_body=extra
    )
    return reply.choices[0].text, stats_of(reply)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_on_global_layers_is_mlx_greedy_over_the_mixed_cache(
    cluster: Cluster, bits: int
) -> None:
    """`kv_bits` quantizes the global layers' K/V (on the wire and in the cache); sliding
    layers stay float. The oracle: mlx-lm generating over the same mixed cache list."""
    spec = load_index(cluster.model).spec
    for seed in range(2):
        prompt = [(97 * seed + 31 * i) % spec.vocab_size for i in range(3 * WINDOW + seed)]
        text, stats = _complete(cluster, prompt, bits)
        assert stats.prefill == "remote" and stats.kv_dtype == f"q{bits}/g64"
        assert text == cluster.tokenizer.decode(_ids(cluster, prompt, bits))
        n, d = len(prompt) - 1, spec.head_dim
        full = 2 * spec.num_kv_heads * n * (d * bits // 8 + 2 * 4 * d // 64)  # words, scales
        window = 2 * spec.num_kv_heads * WINDOW * d * 4  # float32
        want = sum(full if k.kind == "full" else window for k in spec.layer_kinds)
        assert 0 < stats.kv_bytes - want < 1024 * spec.num_layers


def test_three_turns_past_the_window_reuse_the_cache_exactly(cluster: Cluster) -> None:
    """Each turn extends the last (its prompt, its reply, new tokens): the decode node reuses
    the cached conversation whole, though its windows cannot be cut back, and the reply
    equals mlx-lm's greedy from scratch. An edit inside the cached part falls back to the
    longest point held exactly (turn one's), and says so."""
    vocab = load_index(cluster.model).spec.vocab_size
    fresh = [[(13 * turn + 7 * i + 5) % vocab for i in range(WINDOW + 3)] for turn in range(3)]
    prompt: list[int] = []
    held = 0  # positions the decode node keeps after a turn: prompt and reply (the batch feeds
    # every token it hands out)
    points = []
    for turn in range(3):
        prompt = prompt + fresh[turn]
        text, stats = _complete(cluster, prompt)
        ids = _ids(cluster, prompt)
        assert text == cluster.tokenizer.decode(ids)
        assert (stats.cached_tokens, stats.cache_fallback) == (held, False)
        assert stats.prefill == "remote" and stats.prefill_tokens == len(prompt) - 1 - held
        assert stats.decode_tokens == len(ids)
        held = len(prompt) + len(ids)
        points.append(held)
        prompt = prompt + ids
    assert held > 4 * WINDOW
    edited = list(prompt)
    edited[points[1] - 2] = (edited[points[1] - 2] + 1) % vocab  # inside turn two
    text, stats = _complete(cluster, edited)
    assert text == cluster.tokenizer.decode(_ids(cluster, edited))
    assert (stats.cached_tokens, stats.cache_fallback) == (points[0], True)
