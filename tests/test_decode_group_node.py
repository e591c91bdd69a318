"""A decode node as a group of two ranks (issue 38), started by `mlx.launch` on loopback with
the ring backend: answers through the openai client equal single-process mlx-lm's greedy
generation with the prefill remote (each layer's K/V or state sent on to the rank that holds
it), across turns; `/health` shows each rank's share; a dense family (our stages) and Qwen3.5
(mlx-lm's own pipeline, its states on the wire). The failures (the prefill node killed
mid-way, then rank 1 killed) are in test_decode_group_failure.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.group_support import start_group, stop_ranks
from tests.nodeproc import start_node, stop_all, wait_healthy, wait_trusted
from tests.records import stats_of
from tests.test_handoff import PROMPTS, TOKEN, Cluster, _chat
from tests.test_qwen3_5_handoff import _complete, _ids, _text, assert_quantized_kv_exact

MODELS = {
    "llama": {"arch": "llama", "layers": 4, "heads": 2, "kv_heads": 1, "head_dim": 64},
    "qwen3_5": {
        "arch": "qwen3_5",
        "layers": 8,
        "layout": "hf",
        "heads": 2,
        "kv_heads": 1,
        "head_dim": 64,
    },  # rank 0: layers 4..7
}


@pytest.fixture(scope="module", params=list(MODELS))
def group(
    request: pytest.FixtureRequest, tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    model = tiny_model(**MODELS[request.param])
    tmp = tmp_path_factory.mktemp(f"group-{request.param}")
    prefill = start_node(tmp, model, "prefill", token=TOKEN, wait=False)
    decode = start_group(tmp, model, "--peer", prefill.url, "--remote-prefill", "always",
                         token=TOKEN)  # fmt: skip
    try:
        wait_healthy(prefill)
        wait_healthy(decode)
        wait_trusted(decode)
        yield Cluster(model, prefill, decode)
    finally:
        stop_all([decode, prefill])
        stop_ranks(decode)


def test_remote_chat_through_the_group_is_mlx_greedy(group: Cluster) -> None:
    for prompt in PROMPTS[:2]:
        reply = _chat(group.client(), prompt)
        stats = stats_of(reply)
        assert stats.prefill == "remote", group.decode.output()
        assert reply.choices[0].message.content == group.reference(prompt)
    chunks = list(_chat(group.client(), PROMPTS[3], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == group.reference(PROMPTS[3])


def test_health_shows_each_rank_holding_its_share(group: Cluster) -> None:
    health = group.decode.health()
    g = health.group
    assert g is not None
    # its ranks batch alike: every reply steps in one batch
    assert health.batching is not None and health.batching.mode == "continuous"
    index = load_index(group.model)
    n = index.spec.num_layers
    assert (g.size, g.backend) == (2, "ring")
    spans = {r.rank: r.layers for r in g.ranks}
    assert spans == {0: (n // 2, n), 1: (0, n // 2)}  # equal memory: equal halves
    shared = sum(e.nbytes for e in index.globals.values())
    for r in g.ranks:
        first, end = r.layers
        own = sum(index.layer_bytes(i) for i in range(first, end))
        assert abs(r.weight_bytes - (shared + own)) <= 1024 + 0.01 * own
        assert r.mem_bytes > 0 and r.host == "127.0.0.1"


def test_three_turns_through_the_group_prefill_only_their_new_tokens(group: Cluster) -> None:
    """Each turn extends the last: rank 0's prompt cache (the other rank's caches mirrored
    by id) reuses the conversation, the prefill node sends the new positions only, and the
    reply equals mlx-lm's from scratch."""
    vocab = load_index(group.model).spec.vocab_size
    prompt: list[int] = []
    held = 0
    for turn in range(3):
        prompt = prompt + [(13 * turn + 7 * i + 5) % vocab for i in range(9)]
        text, stats = _complete(group, prompt)
        ids = _ids(group, prompt)
        assert text == _text(group, ids)
        assert stats.cached_tokens == held and stats.prefill == "remote"
        assert stats.prefill_tokens == len(prompt) - 1 - held
        held = len(prompt) + len(ids) - 1
        prompt = prompt + ids


def test_quantized_kv_goes_to_each_rank_quantized(group: Cluster) -> None:
    """`kv_bits`: each rank's full layers get the quantized frames (rank 0 quantizing its
    caches after the prompt orders the others to, as mlx-lm's own `kv_bits` does)."""
    assert_quantized_kv_exact(group, 30)


def test_a_chat_of_two_turns_is_exact(group: Cluster) -> None:
    from mlx_lm import generate

    messages = [{"role": "user", "content": "Name a colour."}]
    first = group.client().chat.completions.create(
        model="m", messages=messages, max_tokens=12, temperature=0
    )
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And another one?"}]  # fmt: skip
    second = group.client().chat.completions.create(
        model="m", messages=messages, max_tokens=12, temperature=0
    )
    ids = group.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert second.choices[0].message.content == generate(
        group.mlx_model, group.tokenizer, ids, max_tokens=12
    )
    assert stats_of(second).cached_tokens > 0


def test_four_replies_at_once_step_in_one_batch_on_every_rank(group: Cluster) -> None:
    """Issue 46: four completions sent together step in one batch across the ranks (each
    rank runs its layers over [4, 1] tokens, `group/batch.py`): `/health` sees a step of
    more than one reply while they run, and each reply is mlx-lm's greedy from scratch."""
    import threading
    import time

    vocab = load_index(group.model).spec.vocab_size
    prompts = [[(31 * k + 7 * i + 3) % vocab for i in range(12 + 5 * k)] for k in range(4)]
    n = 48
    replies: dict[int, str] = {}
    seen: list[int] = []
    running = threading.Event()

    def complete(k: int) -> None:
        r = group.client().completions.create(
            model="m", prompt=prompts[k], max_tokens=n, temperature=0
        )
        replies[k] = r.choices[0].text

    def watch() -> None:
        while running.is_set():
            b = group.decode.health().batching
            seen.append(b.batch if b is not None else 0)
            time.sleep(0.005)

    running.set()
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=complete, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        running.clear()
        watcher.join()
    eos = set(group.tokenizer.eos_token_ids)
    for k in range(4):
        ids = _ids(group, prompts[k], n=n)
        ids = ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]  # it stops
        assert replies[k] == _text(group, ids), k
    assert max(seen) >= 2, seen
