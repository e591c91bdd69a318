"""A prefill node of two ranks (`--devices cpu,cpu`: torchrun with a rank per device, gloo)
serving a decode node (issue 52): greedy replies equal mlx-lm's; `/health` shows both ranks,
each holding and streaming half of every layer; a client gone mid-prefill leaves the ranks in
step; killing rank 1 mid-prefill leaves the reply exact (the decode node prefills it itself),
within seconds, and the prefill node exits."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tandem.nodes.model import load_index

from tests.conftest import MakeTiny
from tests.nodeproc import NodeProc, remote_pair
from tests.records import stats_of
from tests.test_handoff import MAX_TOKENS, PROMPTS, TOKEN, Cluster, _chat

MODELS = {
    "llama": {"arch": "llama", "layers": 4, "intermediate": 256},
    "qwen3_5": {"arch": "qwen3_5", "layers": 4, "intermediate": 256},
}
TWO_RANKS = ("--devices", "cpu,cpu")


def _layer_bytes(model: Path) -> int:
    index = load_index(model)
    return sum(index.layer_bytes(i) for i in range(index.spec.num_layers))


@pytest.fixture(scope="module", params=list(MODELS))
def cluster(
    request: pytest.FixtureRequest, tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    model = tiny_model(**MODELS[request.param])
    budget = str(_layer_bytes(model) // 4)
    tmp = tmp_path_factory.mktemp("ranks-node")
    with remote_pair(tmp, model, budget, TOKEN, *TWO_RANKS) as (prefill, decode):
        yield Cluster(model, prefill, decode)


def test_remote_replies_from_two_ranks_are_mlx_greedy(cluster: Cluster) -> None:
    for prompt in PROMPTS[:2]:
        reply = _chat(cluster.client(), prompt)
        assert stats_of(reply).prefill == "remote", cluster.decode.output()
        assert reply.choices[0].message.content == cluster.reference(prompt)
    ranks = cluster.prefill.health().prefill_ranks
    assert ranks is not None and ranks.size == 2 and ranks.backend == "gloo" and not ranks.lost
    half = _layer_bytes(cluster.model) / 2
    for rank in ranks.ranks:  # each holds half of every layer, and streamed the same
        assert abs(rank.weight_bytes - half) <= 0.06 * half, rank
        assert rank.pass_bytes == ranks.ranks[0].pass_bytes > 0
        assert rank.pass_reduced_bytes > 0
    assert [r.rank for r in ranks.ranks] == [0, 1]


async def test_replies_at_once_and_a_second_turn_are_mlx_greedy(cluster: Cluster) -> None:
    """Four chats at once (passes of several prompts, every rank in step), then a second turn
    of one of them (the prefill node's cached prefix sent to rank 1)."""
    client = cluster.aclient()
    prompts = [f"{p} Say it in a few words." for p in PROMPTS]  # none in the prompt cache yet
    replies = await asyncio.gather(*(
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": p}],
                                       max_tokens=MAX_TOKENS, temperature=0)
        for p in prompts
    ))  # fmt: skip
    for prompt, reply in zip(prompts, replies, strict=True):
        assert stats_of(reply).prefill == "remote"
        assert reply.choices[0].message.content == cluster.reference(prompt)
    turn = [{"role": "user", "content": prompts[0]},
            {"role": "assistant", "content": replies[0].choices[0].message.content},
            {"role": "user", "content": "And what happened next?"}]  # fmt: skip
    again = await client.chat.completions.create(model="m", messages=turn,  # type: ignore[arg-type]
                                                 max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    assert stats_of(again).prefill == "remote"
    tokens = cluster.tokenizer.apply_chat_template(turn, add_generation_prompt=True)
    from mlx_lm import generate

    want = generate(cluster.mlx_model, cluster.tokenizer, list(tokens), max_tokens=MAX_TOKENS)
    assert again.choices[0].message.content == want


def _rank_pid(agent: NodeProc, rank: int) -> int:
    """The pid of torchrun's worker of `rank` (a child of the agent the node became)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == agent.proc.pid and f"RANK={rank}".encode() in env:
            return int(entry)
    raise AssertionError(f"no rank {rank} under {agent.proc.pid}")


def test_a_rank_killed_mid_prefill_leaves_the_reply_exact(
    tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = tiny_model(**MODELS["llama"])
    budget = str(_layer_bytes(model) // 4)
    tmp = tmp_path_factory.mktemp("ranks-kill")
    # a slow link: a pass takes about two seconds, so the kill lands inside it
    slow = (*TWO_RANKS, "--link-gbps", "0.002")
    with remote_pair(tmp, model, budget, TOKEN, *slow) as (prefill, decode):
        cluster = Cluster(model, prefill, decode)
        # a client gone mid-prefill: the ranks run the pass to its end, in step, and serve on
        with pytest.raises(openai.APITimeoutError):
            _chat(cluster.client().with_options(timeout=0.7, max_retries=0), PROMPTS[1])
        time.sleep(2.5)
        again = _chat(cluster.client(), PROMPTS[1])
        assert stats_of(again).prefill == "remote", decode.output()
        assert again.choices[0].message.content == cluster.reference(PROMPTS[1])
        assert prefill.health().prefill_ranks.lost == ""  # type: ignore[union-attr]
        replies: list[object] = []
        asked = threading.Thread(
            target=lambda: replies.append(_chat(cluster.client(), PROMPTS[0])), daemon=True
        )
        t0 = time.monotonic()
        asked.start()
        time.sleep(0.8)
        os.kill(_rank_pid(prefill, 1), signal.SIGKILL)
        asked.join(30)
        took = time.monotonic() - t0
        assert replies, decode.output()
        reply = replies[0]
        assert stats_of(reply).prefill == "local", decode.output()  # type: ignore[arg-type]
        assert reply.choices[0].message.content == cluster.reference(PROMPTS[0])  # type: ignore[attr-defined]
        assert took < 15, took
        prefill.proc.wait(15)  # the prefill node is gone (torchrun stopped rank 0 too)
