"""Qwen3-MoE through real nodes with the openai client: a remote prefill at a budget below
one layer's experts (they stream in several loads), then mlx-lm's decode; replies equal
mlx-lm's own greedy generation, for both expert layouts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.handoff_checks import assert_completion_is_mlx
from tests.nodeproc import remote_pair
from tests.records import stats_of
from tests.test_handoff import PROMPTS, TOKEN, Cluster, _chat


@pytest.fixture(scope="module", params=["stacked", "per-expert"])
def cluster(
    request: pytest.FixtureRequest, tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    model = tiny_model(arch="qwen3_moe", layers=4, experts=8, top_k=2, mlp_only_layers=(1,),
                       expert_layout=request.param)  # fmt: skip
    index = load_index(model)
    experts = sum(e.nbytes for k, e in index.layers[0].items() if "expert" in k or "switch" in k)
    budget = str(experts * 2 // 3)
    with remote_pair(tmp_path_factory.mktemp("moe"), model, budget, TOKEN) as (prefill, decode):
        yield Cluster(model, prefill, decode)


def test_remote_chat_is_exactly_mlx_greedy(cluster: Cluster) -> None:
    for prompt in PROMPTS[:2]:
        reply = _chat(cluster.client(), prompt)
        assert stats_of(reply).prefill == "remote", cluster.decode.output()
        assert reply.choices[0].message.content == cluster.reference(prompt)


def test_completions_equal_mlx(cluster: Cluster) -> None:
    assert_completion_is_mlx(cluster, 8)
