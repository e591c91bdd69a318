"""Checks the handoff tests of several families share, on test_handoff.py's `Cluster` (a
prefill node and a decode node that always prefills on it)."""

from __future__ import annotations

from tests.records import stats_of
from tests.test_handoff import Cluster

WORDS = "The quick brown fox jumps over the lazy dog by the river bank"


def assert_completion_is_mlx(cluster: Cluster, max_tokens: int) -> None:
    """A plain completion of WORDS is prefilled remotely and equals mlx-lm's greedy text."""
    from mlx_lm import generate

    reply = cluster.client().completions.create(
        model="m", prompt=WORDS, max_tokens=max_tokens, temperature=0
    )
    assert stats_of(reply).prefill == "remote"
    assert reply.choices[0].text == generate(
        cluster.mlx_model, cluster.tokenizer, WORDS, max_tokens=max_tokens
    )


def greedy_ids(cluster: Cluster, prompt: list[int], n: int = 8) -> list[int]:
    """mlx-lm's own greedy token ids after `prompt`, from scratch."""
    from tandem.nodes.decode.reference import reference_tokens

    return list(reference_tokens(cluster.mlx_model, cluster.tokenizer, prompt, n))


def served_text(cluster: Cluster, ids: list[int]) -> str:
    """The ids as mlx-lm's server writes them (its streaming detokenizer: a reply's leading
    space trimmed)."""
    detok = cluster.tokenizer.detokenizer
    detok.reset()
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    return str(detok.text)


def assert_three_turns_reuse_the_cache(cluster: Cluster, fresh: list[list[int]]) -> int:
    """Each turn extends the last (its prompt, its reply, `fresh[turn]`): the decode node
    reuses the cached conversation whole, prefills only the new tokens remotely, and the reply
    equals mlx-lm's greedy from scratch. The positions held after the last turn."""
    prompt: list[int] = []
    held = 0  # positions the decode node keeps after a turn: prompt and reply
    for turn, new in enumerate(fresh):
        prompt = prompt + new
        reply = cluster.client().completions.create(
            model="m", prompt=prompt, max_tokens=8, temperature=0
        )
        stats, ids = stats_of(reply), greedy_ids(cluster, prompt)
        assert reply.choices[0].text == served_text(cluster, ids), turn
        assert (stats.cached_tokens, stats.cache_fallback) == (held, False)
        assert stats.prefill == "remote" and stats.prefill_tokens == len(prompt) - 1 - held
        held = len(prompt) + len(ids)
        prompt = prompt + ids
    return held
