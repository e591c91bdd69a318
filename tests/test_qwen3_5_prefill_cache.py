"""The prefill node's prefix cache with Qwen3.5's linear-layer states: an entry serves only a
prompt that extends it whole (a state cannot be cut back), an edit inside an entry falls back
to an earlier one it extends whole, and `reusing` over a real engine gives the frames a fresh
prefill gives. A made fp32 `qwen3_5` (8 layers, HF layout), on CPU."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import Handed, LinearState
from tandem.nodes.prefill.serving.prefix_cache import PrefixCache, reusing

from tests.conftest import MakeTiny
from tests.test_qwen3_5_prefill import CHUNK, as_prefix, prompt, quarter, qwen_args, run

TOKENS = prompt(40)
# turn 1's prompt: turn 2's chunks then fall where a fresh prefill's do (other chunk bounds
# alone move the last full layer's K by ~1.2e-5 in fp32, past this file's 1e-5)
FIRST = CHUNK
EDITED = TOKENS[:18] + [(t + 1) % 512 for t in TOKENS[18:30]]  # diverges at position 18


@pytest.fixture(scope="module")
def engine(tiny_model: MakeTiny) -> Iterator[PrefillEngine]:
    model_dir: Path = tiny_model(**qwen_args("qwen3_5", layout="hf"))
    engine = PrefillEngine(model_dir, device="cpu", chunk_tokens=CHUNK,
                           budget=quarter(load_index(model_dir)))  # fmt: skip
    yield engine
    engine.close()


def test_an_entry_with_states_serves_only_prompts_that_extend_it_whole(
    engine: PrefillEngine,
) -> None:
    cache = PrefixCache()
    short, long = as_prefix(run(engine, TOKENS[:5])), as_prefix(run(engine, TOKENS[:24]))
    cache.store(TOKENS[:5], short)
    cache.store(TOKENS[:24], long)  # the shorter entry kept beside it: its states differ
    j, got = cache.lookup(TOKENS[:40])  # extends the longer whole
    assert j == 24 and got is not None
    for ours, stored in zip(got, long, strict=True):
        if isinstance(stored, dict):
            assert ours is stored  # the state as stored, never cut
        else:
            assert torch.equal(ours[0], stored[0]) and ours[0].shape[2] == 24
    assert (cache.exact_hits, cache.misses) == (0, 0)
    j, got = cache.lookup(EDITED)  # diverges inside the longer: the shorter, whole
    assert j == 5 and got is not None and (cache.exact_hits, cache.misses) == (1, 0)
    assert all(ours is stored for ours, stored in zip(got, short, strict=True)
               if isinstance(stored, dict))  # fmt: skip
    j, got = cache.lookup(TOKENS[:24])  # itself: one position is always computed
    assert j == 5 and (cache.exact_hits, cache.misses) == (2, 0)
    assert cache.lookup([*TOKENS[:3], 7, 7, 7]) == (0, None)  # inside the shorter: nothing
    assert (cache.exact_hits, cache.misses) == (2, 1)


def _turn(
    engine: PrefillEngine, cache: PrefixCache, tokens: Sequence[int], start: int
) -> tuple[list[Handed], int]:
    """One turn through `reusing`: its frames of positions start.. and the positions computed."""
    req = PrefillBody(fingerprint="qwen3_5", request_id="turn", tokens=list(tokens), start=start)
    gen = reusing(engine, cache, req)
    frames: list[Handed] = []
    while True:
        try:
            frames.append(next(gen))
        except StopIteration as stop:
            return frames, stop.value


def _assert_same(frames: Sequence[Handed], fresh: Sequence[Handed], start: int) -> None:
    for ours, theirs in zip(frames, fresh, strict=True):
        assert ours.layer == theirs.layer and type(ours) is type(theirs)
        if isinstance(ours, LinearState):
            assert isinstance(theirs, LinearState)
            for name, t in theirs.tensors.items():
                np.testing.assert_allclose(ours.tensors[name].numpy(), t.numpy(), rtol=0,
                                           atol=1e-5, err_msg=f"{ours.layer} {name}")  # fmt: skip
            continue
        for a, b in ((ours.k, theirs.k), (ours.v, theirs.v)):  # type: ignore[union-attr]
            np.testing.assert_allclose(a.numpy(), b[:, :, start:].numpy(), rtol=0, atol=1e-5,
                                       err_msg=f"{ours.layer}")  # fmt: skip


@pytest.mark.parametrize("start", [0, FIRST])  # every position sent, or only the new ones
def test_reusing_gives_a_fresh_prefills_frames(engine: PrefillEngine, start: int) -> None:
    """Turn 1 stores its prompt; turn 2 extends it and computes only its new positions; turn 3
    edits inside turn 2 and falls back to turn 1's entry. Each turn's frames are a fresh
    prefill's."""
    cache = PrefixCache()
    frames, computed = _turn(engine, cache, TOKENS[:FIRST], 0)
    assert computed == FIRST and cache.misses == 1
    _assert_same(frames, run(engine, TOKENS[:FIRST]), 0)
    frames, computed = _turn(engine, cache, TOKENS[:30], start)
    assert computed == 30 - FIRST and (cache.exact_hits, cache.misses) == (0, 1)
    _assert_same(frames, run(engine, TOKENS[:30]), start)
    frames, computed = _turn(engine, cache, EDITED, start)
    assert computed == len(EDITED) - FIRST and (cache.exact_hits, cache.misses) == (1, 1)
    _assert_same(frames, run(engine, EDITED), start)
