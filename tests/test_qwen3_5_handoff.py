"""Qwen3.5 (hybrid linear attention) through real nodes: a remote prefill sends K/V for the
full-attention layers and each linear layer's state (proto 4 state frames), which fill
mlx-lm's own cache list (`ArraysCache` on linear layers), and greedy tokens equal mlx-lm's
own generation; quantized K/V on the full layers only; prompt caches across turns, each turn
prefilling only its new tokens, an edit falling back to a stored point."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.model.index import load_index
from tandem.nodes.model.kv_bytes import kv_bytes

from tests.conftest import MakeTiny
from tests.nodeproc import remote_pair
from tests.records import stats_of
from tests.test_handoff import PROMPTS, TOKEN, Cluster, _chat

LAYERS = 8  # linear but every 4th


@pytest.fixture(scope="module")
def cluster(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tiny_model(arch="qwen3_5", layers=LAYERS, layout="hf", heads=2, kv_heads=1, head_dim=64)
    index = load_index(model)
    quarter = sum(index.layer_bytes(i) for i in range(LAYERS)) // 4
    with remote_pair(tmp_path_factory.mktemp("qwen3_5"), model, str(quarter), TOKEN) as nodes:
        yield Cluster(model, *nodes)


def _ids(cluster: Cluster, prompt: list[int], bits: int = 0, n: int = 6) -> list[int]:
    """mlx-lm's greedy token ids from scratch (with `bits`, its full layers' K/V quantized
    after the prompt, as mlx-lm's own `kv_bits` does)."""
    from tandem.nodes.contract.http import KVFormat
    from tandem.nodes.decode.reference import reference_tokens

    fmt = KVFormat(bits) if bits else None
    return list(reference_tokens(cluster.mlx_model, cluster.tokenizer, prompt, n, kv_format=fmt))


def _text(cluster: Cluster, ids: list[int]) -> str:
    """Token ids as mlx-lm's streaming detokenizer gives them (a reply's text)."""
    detokenizer = cluster.tokenizer.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def _complete(cluster: Cluster, prompt: list[int], bits: int = 0) -> tuple[str, ReplyStats]:
    extra = {"tandem": {"kv_bits": bits}} if bits else None
    reply = cluster.client().completions.create(
        model="m", prompt=prompt, max_tokens=6, temperature=0, extra_body=extra
    )
    return reply.choices[0].text, stats_of(reply)


def assert_quantized_kv_exact(cluster: Cluster, prompt_tokens: int) -> None:
    """A prompt of `prompt_tokens` ids with `kv_bits` 8: prefilled remotely, its K/V held as
    q8/g64, and the reply is mlx-lm's greedy with its own `kv_bits`."""
    vocab = load_index(cluster.model).spec.vocab_size
    prompt = [(37 * i + 11) % vocab for i in range(prompt_tokens)]
    text, stats = _complete(cluster, prompt, 8)
    assert stats.prefill == "remote" and stats.kv_dtype == "q8/g64"
    assert text == _text(cluster, _ids(cluster, prompt, 8))


def test_remote_chat_is_exactly_mlx_greedy_with_state_on_the_wire(cluster: Cluster) -> None:
    spec = load_index(cluster.model).spec
    assert sum(k.kind == "linear" for k in spec.layer_kinds) == 6
    for prompt in PROMPTS[:2]:
        n = len(cluster.chat_tokens(prompt))
        reply = _chat(cluster.client(), prompt)
        stats = stats_of(reply)
        assert stats.prefill == "remote", cluster.decode.output()
        assert stats.prefill_tokens == n - 1
        assert reply.choices[0].message.content == cluster.reference(prompt)
        # K/V of two full layers, six fixed-size states, and each frame's header
        want = kv_bytes(spec).at(n - 1)
        assert want == 2 * 2 * spec.num_kv_heads * spec.head_dim * 4 * (n - 1) + 6 * (
            3 * spec.linear.conv_dim * 4 + spec.linear.num_v_heads * 32 * 32 * 4  # type: ignore[union-attr]
        )
        assert 0 < stats.kv_bytes - want < 1024 * LAYERS


def test_streamed_chat_equals_mlx(cluster: Cluster) -> None:
    chunks = list(_chat(cluster.client(), PROMPTS[3], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert stats_of(chunks[-1]).prefill == "remote"
    assert text == cluster.reference(PROMPTS[3])


def test_quantized_kv_on_full_layers_keeps_state_in_float(cluster: Cluster) -> None:
    assert_quantized_kv_exact(cluster, 40)


def test_three_turns_prefill_only_their_new_tokens(cluster: Cluster) -> None:
    """Each turn extends the last (its prompt, its reply, new tokens): the decode node reuses
    the cached conversation whole (a state cannot be cut back), asks the prefill node for
    the new tokens only, and the reply equals mlx-lm's greedy from scratch. An edit inside
    turn three's reply falls back to the snapshot at the end of turn three's prompt."""
    vocab = load_index(cluster.model).spec.vocab_size
    fresh = [[(13 * turn + 7 * i + 5) % vocab for i in range(11)] for turn in range(3)]
    prompt: list[int] = []
    held = 0  # positions the decode node keeps after a turn: prompt and reply (the batch feeds
    # every token it hands out)
    for turn in range(3):
        prompt = prompt + fresh[turn]
        text, stats = _complete(cluster, prompt)
        ids = _ids(cluster, prompt)
        assert text == _text(cluster, ids)
        assert (stats.cached_tokens, stats.cache_fallback) == (held, False)
        assert stats.prefill == "remote" and stats.prefill_tokens == len(prompt) - 1 - held
        last_prompt = len(prompt)
        held = len(prompt) + len(ids)
        prompt = prompt + ids
    edited = list(prompt)
    edited[-2] = (edited[-2] + 1) % vocab  # inside turn three's reply
    text, stats = _complete(cluster, edited)
    assert text == _text(cluster, _ids(cluster, edited))
    assert (stats.cached_tokens, stats.cache_fallback) == (last_prompt - 1, True)
    assert stats.prefill_tokens == len(edited) - last_prompt
