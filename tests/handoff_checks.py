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
