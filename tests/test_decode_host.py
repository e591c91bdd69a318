"""The decode node's token loop against mlx-lm itself, in-process: a reply through the node's
scheduler at every length from one token up, the first token handed out before the second is
computed, and the steady-state rate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from tandem.nodes.decode.batching import Batcher
from tandem.nodes.decode.generate import steps
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.openai_api import Sampling
from tandem.nodes.decode.reply import Generation

from tests.decode_support import reply


@pytest.fixture(scope="module")
def host(tiny_model) -> ModelHost:
    model: Path = tiny_model(arch="llama", layers=2)
    h = ModelHost(model)
    asyncio.run(h.start())
    yield h
    h.close()


def _mlx_tokens(h: ModelHost, prompt: list[int], n: int) -> list[int]:
    out = [r.token for r in stream_generate(h.model, h.tokenizer, mx.array(prompt), max_tokens=n)]
    return out[:n]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_tokens_equal_mlx_lm_greedy_at_every_length(host: ModelHost, max_tokens: int) -> None:
    prompt = host.encode("The lighthouse keeper counted the waves and")
    done, _, _ = asyncio.run(reply(Batcher(host), prompt, Sampling(max_tokens, 0.0)))
    want = _mlx_tokens(host, prompt, max_tokens)
    eos = set(host.tokenizer.eos_token_ids)
    if eos & set(want):  # mlx-lm stops before its eos; tandem reports it and stops too
        want = want[: min(i for i, t in enumerate(want) if t in eos) + 1]
    assert done.token_ids == want
    assert len(done.token_at) == done.tokens <= max_tokens


def test_first_token_comes_before_the_second_is_computed(host: ModelHost) -> None:
    """The generator yields token 1 having run one forward pass over the last prompt token:
    the cache then holds the prompt and nothing more."""
    prompt = host.encode("Why is the sky blue?")
    cache = host.new_cache()
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731

    def first_offset() -> int:
        tokens = steps(host.model, mx.array(prompt), cache, sampler, 5)
        next(tokens)
        offset = cache[0].offset
        tokens.close()
        return offset

    assert host.thread.submit(first_offset).result() == len(prompt)


def test_steady_rate_skips_the_first_interval() -> None:
    g = Generation(token_at=[0.0, 5.0, 6.0, 7.0, 8.0])  # a slow start, then 1 token/s
    assert g.steady_tok_s == pytest.approx(1.0)
    assert Generation(token_at=[0.0, 1.0]).steady_tok_s is None
