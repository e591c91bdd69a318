"""The decode node's scheduler on the real SmolLM2 in float32 (issue 46; made random-weight
models have near-tie logits, so a batch's replies may differ from their lone runs there):
replies that run at once step in one batch, and each equals its lone run and mlx-lm's own
greedy generation; a reply dropped mid-stream leaves the others exact; a batch that mixes a
local prefill, a remote one (K/V from the prefill engine), a cached conversation and a
quantized cache (which runs beside the batch, a step a tick) is exact for each."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from tandem.app.cli.real_model import RealModel
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.batching import Batcher, Join
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.openai_api import Sampling
from tandem.nodes.model.spec import load_spec

from tests.decode_support import reply
from tests.handoff_quality import from_float

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Name three colours of the rainbow.",
]
MAX_TOKENS = 16
GREEDY = Sampling(MAX_TOKENS, 0.0)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def host(real_model: RealModel) -> Iterator[ModelHost]:
    h = ModelHost(real_model.path("float32"))
    asyncio.run(h.start())
    yield h
    h.close()


@pytest.fixture(scope="module")
def prompts(host: ModelHost) -> list[list[int]]:
    return [host.chat_tokens([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def greedy(host: ModelHost, prompts: list[list[int]]) -> list[list[int]]:
    """mlx-lm's own greedy tokens for each prompt, from scratch."""

    def theirs(prompt: list[int]) -> list[int]:
        steps = stream_generate(host.model, host.tokenizer, mx.array(prompt), MAX_TOKENS)
        return [r.token for r in steps][:MAX_TOKENS]

    return [host.thread.submit(theirs, p).result() for p in prompts]


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """mlx-lm stops before its eos; a reply reports the eos token and stops there too."""
    hits = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: hits[0] + 1] if hits else tokens


async def _together(batcher: Batcher, joins: list[Join]) -> list[Any]:
    """Every join's reply at once: (Generation, text, caches) each."""

    async def one(join: Join) -> Any:
        return await reply(batcher, join.prompt, join.params, join.caches,
                           kv_format=join.kv_format)  # fmt: skip

    return await asyncio.gather(*(one(j) for j in joins))


def _fresh(host: ModelHost) -> lm.Caches:
    return host.thread.submit(host.new_cache).result()


def test_four_replies_at_once_step_in_one_batch_and_each_equals_mlx_lm(
    host: ModelHost, prompts: list[list[int]], greedy: list[list[int]]
) -> None:
    eos = set(host.tokenizer.eos_token_ids)
    batcher = Batcher(host)
    joins = [Join(p, _fresh(host), GREEDY) for p in prompts]
    together = asyncio.run(_together(batcher, joins))
    assert max(batcher.batch_sizes) == len(prompts)  # they stepped as one batch
    for (gen, text, caches), prompt, want in zip(together, prompts, greedy, strict=True):
        assert gen.token_ids == _until_eos(want, eos)
        assert text == host.tokenizer.decode([t for t in gen.token_ids if t not in eos])
        # the caches it ends with hold the prompt and every token the batch was fed
        assert lm.positions(caches) == len(prompt) + gen.tokens
    alone = asyncio.run(reply(Batcher(host), prompts[1], GREEDY))
    assert alone[0].token_ids == together[1][0].token_ids
    assert batcher.running == 0


def test_a_reply_whose_reader_leaves_leaves_the_others_exact(
    host: ModelHost, prompts: list[list[int]], greedy: list[list[int]]
) -> None:
    eos = set(host.tokenizer.eos_token_ids)
    batcher = Batcher(host, flush_s=0)

    async def run() -> list[Any]:
        async def leaver() -> int:
            join = Join(prompts[2], await host.thread.call(host.new_cache), GREEDY)
            pieces = 0
            async with batcher.reply(join) as r:
                async for _ in r:
                    pieces += 1
                    if pieces == 3:
                        break  # the client went away mid-stream
            return pieces

        others = [
            reply(batcher, p, GREEDY, await host.thread.call(host.new_cache))
            for i, p in enumerate(prompts)
            if i != 2
        ]
        return await asyncio.gather(leaver(), *others)

    left, *others = asyncio.run(run())
    assert left == 3
    for (gen, _, _), want in zip(others, [g for i, g in enumerate(greedy) if i != 2], strict=True):
        assert gen.token_ids == _until_eos(want, eos)
    assert max(batcher.batch_sizes) == 4  # the one that left was in the batch
    assert batcher.running == 0


def test_local_remote_cached_and_quantized_replies_at_once_each_equal_their_lone_run(
    host: ModelHost, real_model: RealModel, prompts: list[list[int]]
) -> None:
    """One reply prefills its prompt itself (local), one starts from the prefill engine's K/V
    (remote), one continues a conversation whose caches an earlier reply left (cached), one
    holds its cache in 8 bits (which mlx-lm cannot merge: it steps beside the batch)."""
    from tandem.nodes.prefill.engine import PrefillEngine

    model_dir = real_model.path("float32")
    spec = load_spec(model_dir)
    engine = PrefillEngine(model_dir, budget=96 * 2**20, device="cpu")
    try:
        remote_kv = [
            (mx.array(layer.k.numpy()), mx.array(layer.v.numpy()))
            for layer in engine.prefill(prompts[1][:-1])
        ]
    finally:
        engine.close()
    first, _, first_caches = asyncio.run(reply(Batcher(host), prompts[0], GREEDY))
    follow_up = host.chat_tokens(
        [
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": host.tokenizer.decode(first.token_ids)},
            {"role": "user", "content": "And of Italy?"},
        ]
    )
    held = lm.positions(first_caches)

    def joins() -> list[Join]:
        """Each reply's start, made anew (a reply's caches grow as it runs)."""
        remote = host.thread.submit(
            from_float, host.model, spec, remote_kv, len(prompts[1]) - 1
        ).result()
        cached = host.thread.submit(lm.clone_prefix, first_caches, held).result()
        return [
            Join(prompts[2], _fresh(host), GREEDY),  # local
            Join(prompts[1][-1:], remote, GREEDY),  # remote
            Join(follow_up[held:], cached, GREEDY),  # the conversation's next turn
            Join(prompts[3], _fresh(host), GREEDY, kv_format=KVFormat(8, 64, lm.device_kernel())),
        ]

    assert follow_up[:held] == (prompts[0] + first.token_ids)[:held] and held > len(prompts[0])
    lone = [asyncio.run(_together(Batcher(host), [j]))[0] for j in joins()]
    batcher = Batcher(host)
    together = asyncio.run(_together(batcher, joins()))
    assert max(batcher.batch_sizes) == 3  # the quantized one steps beside the batch
    for (gen, text, _), (want, want_text, _) in zip(together, lone, strict=True):
        assert gen.token_ids == want.token_ids and text == want_text
