"""GLM-4.x MoE through real nodes with the openai client: Hugging Face's layout (experts one by
one, the multi-token-prediction layer in the file) prefilled remotely at a budget below one
layer's experts (they stream routed), then mlx-lm's decode: chat and completions equal mlx-lm's
own greedy generation, and three turns through the decode node's prompt cache stay exact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.handoff_checks import assert_completion_is_mlx, assert_three_turns_reuse_the_cache
from tests.nodeproc import remote_pair
from tests.records import stats_of
from tests.test_glm4_moe import experts_bytes, glm4_args
from tests.test_handoff import PROMPTS, TOKEN, Cluster, _chat


@pytest.fixture(scope="module")
def cluster(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tiny_model(**glm4_args("per-expert"))
    budget = str(experts_bytes(load_index(model), 1) * 2 // 3)
    with remote_pair(tmp_path_factory.mktemp("glm4"), model, budget, TOKEN) as (prefill, decode):
        yield Cluster(model, prefill, decode)


def test_remote_chat_is_exactly_mlx_greedy(cluster: Cluster) -> None:
    for prompt in PROMPTS[:2]:
        reply = _chat(cluster.client(), prompt)
        assert stats_of(reply).prefill == "remote", cluster.decode.output()
        assert reply.choices[0].message.content == cluster.reference(prompt)


def test_completions_equal_mlx(cluster: Cluster) -> None:
    assert_completion_is_mlx(cluster, 8)


def test_three_turns_reuse_the_cache_exactly(cluster: Cluster) -> None:
    vocab = load_index(cluster.model).spec.vocab_size
    fresh = [[(11 * turn + 5 * i + 3) % vocab for i in range(30)] for turn in range(3)]
    assert_three_turns_reuse_the_cache(cluster, fresh)
