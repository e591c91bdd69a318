"""gpt-oss through real nodes, with the released models' window of 128: a remote prefill (at a
budget below one layer's experts, so they stream routed) fills mlx-lm's own mixed cache list,
and greedy tokens equal mlx-lm's own generation for prompts shorter and longer than the
window, with only each sliding layer's window on the wire; three turns through the prompt
cache; `kv_bits` refused (mlx-lm attends with sinks over a float cache only)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.handoff_checks import assert_three_turns_reuse_the_cache, greedy_ids, served_text
from tests.records import stats_of
from tests.test_gpt_oss import ARGS
from tests.test_handoff import Cluster, _cluster

WINDOW = 128


@pytest.fixture(scope="module")
def cluster(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tiny_model(**{**ARGS, "sliding_window": WINDOW})
    yield from _cluster(tmp_path_factory.mktemp("gpt_oss"), model)


def _complete(cluster: Cluster, prompt: list[int], n: int = 8) -> tuple[str, ReplyStats]:
    reply = cluster.client().completions.create(
        model="m", prompt=prompt, max_tokens=n, temperature=0
    )
    return reply.choices[0].text, stats_of(reply)


@pytest.mark.parametrize("n", [40, WINDOW + 70])
def test_remote_prefill_is_exactly_mlx_greedy(cluster: Cluster, n: int) -> None:
    spec = load_index(cluster.model).spec
    prompt = [(37 * i + n) % spec.vocab_size for i in range(n)]
    text, stats = _complete(cluster, prompt)
    assert stats.prefill == "remote", cluster.decode.output()
    assert text == served_text(cluster, greedy_ids(cluster, prompt))
    # sliding layers send at most their window: K and V in float32, plus each frame's header
    per_position = 2 * spec.num_kv_heads * spec.head_dim * 4
    kept = [n - 1 if k.kind == "full" else min(n - 1, WINDOW) for k in spec.layer_kinds]
    assert 0 < stats.kv_bytes - per_position * sum(kept) < 1024 * spec.num_layers


def test_three_turns_reuse_the_cache_exactly(cluster: Cluster) -> None:
    vocab = load_index(cluster.model).spec.vocab_size
    fresh = [[(11 * turn + 5 * i + 3) % vocab for i in range(60)] for turn in range(3)]
    assert assert_three_turns_reuse_the_cache(cluster, fresh) > WINDOW


def test_quantized_kv_is_refused(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError, match="float only"):
        cluster.client().completions.create(
            model="m", prompt=[1, 2, 3], max_tokens=2, extra_body={"tandem": {"kv_bits": 8}}
        )


def test_a_chat_reply_is_mlx_greedy_split_by_harmony(cluster: Cluster) -> None:
    """Chat: the Harmony template's prompt prefilled remotely; the reply is mlx-lm's greedy
    text, split by channel as `harmony.parse` splits it (random weights write no channels,
    so it is all content)."""
    from tandem.nodes.decode import harmony

    prompt = "Tell me a story about a lighthouse keeper who counted the waves, " * 6
    ids = cluster.chat_tokens(prompt)
    assert len(ids) > WINDOW and cluster.tokenizer.decode(ids).endswith("<|start|>assistant")
    reply = cluster.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
    )
    assert stats_of(reply).prefill == "remote"
    want = harmony.parse(served_text(cluster, greedy_ids(cluster, ids)))
    assert reply.choices[0].message.content == want.content
