"""Issue 18's misbehaving prefill peer: frames that disagree with the model, a quantized stream
cut off, a useless `Retry-After` and a frozen node all end in mlx-lm's exact local answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tandem.nodes.contract.events import RequestEvent

from tests import bad_input_fixtures
from tests.bad_input_support import (
    TOKEN,
    BadPeer,
    Oracle,
    bad_peer,
    chat_body,
    events_since,
    post,
)
from tests.bad_prefill import SLOW_S
from tests.records import stats_of

FROZEN_LIMIT_S = 20.0  # a frozen peer must cost well under its 60 s read timeout


llama = bad_input_fixtures.llama  # module-scoped: the model and mlx-lm as its oracle
oracle = bad_input_fixtures.oracle


@pytest.fixture(scope="module")
def bad(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BadPeer]:
    with bad_peer(llama, tmp_path_factory.mktemp("bad")) as peer:
        yield peer


# --- 7: frames that disagree with the model: a validated local fallback -------------------

FRAME_CASES = ["count_more", "count_less", "heads", "head_dim", "f16", "nan", "inf"]


@pytest.mark.parametrize("mode", FRAME_CASES)
def test_bad_frames_fall_back_to_an_exact_local_prefill(
    bad: BadPeer, oracle: Oracle, mode: str
) -> None:
    prompt = f"The keeper of the {mode.replace('_', ' ')} lighthouse counted the waves again."
    bad.set_mode(mode)
    t0 = time.time()
    try:
        reply = post(bad.decode.url + "/v1/chat/completions", chat_body(prompt), timeout=60)
        served = [c["request_id"] for c in bad.prefills()]
    finally:
        bad.set_mode("good")
    assert reply.status == 200, f"{reply}\n{bad.decode.output()[-3000:]}"
    body = reply.json()
    assert body["id"] in served, "the bad frames were never asked for"
    assert body["choices"][0]["message"]["content"] == oracle.reference(prompt)
    records = [r for r in events_since(bad.decode, t0) if r.request_id == body["id"]]
    phases = [r.phase for r in records if isinstance(r, RequestEvent)]
    assert "failed" in phases, phases
    assert stats_of(body).prefill == "local", stats_of(body)


def test_a_refused_first_frame_falls_back_at_once_while_the_node_computes_on(
    bad: BadPeer, oracle: Oracle
) -> None:
    """Issue 47: layer 0's K is NaN and the node takes SLOW_S for each next layer (a long
    prompt): the decode node refuses the frame and prefills locally at once, instead of
    waiting on a queue nobody reads until `--remote-timeout`."""
    prompt = "The keeper of the slow lighthouse counted the waves once more."
    bad.set_mode("nan_then_slow")
    t0 = time.monotonic()
    try:
        reply = post(bad.decode.url + "/v1/chat/completions", chat_body(prompt), timeout=60)
    finally:
        bad.set_mode("good")
    elapsed = time.monotonic() - t0
    assert reply.status == 200, reply
    body = reply.json()
    assert stats_of(body).prefill == "local"
    assert body["choices"][0]["message"]["content"] == oracle.reference(prompt)
    assert elapsed < SLOW_S / 2, f"the fallback took {elapsed:.1f} s"


def test_a_quantized_prefill_cut_off_falls_back_to_mlx_lms_own(tiny_model, tmp_path: Path) -> None:
    """Two quantized layers land, then the prefill node hangs up: the local prefill that
    follows runs on the caches as they were before the request (float, quantized after the
    prompt as mlx-lm does), not on the two layers the failed stream had made quantized."""
    model = tiny_model(arch="llama", layers=4, hidden=64, heads=2, kv_heads=1, head_dim=64)
    oracle = Oracle(model)
    prompt = "The keeper counted the waves, the gulls and the ships that never came back."
    with bad_peer(model, tmp_path) as bad:
        got, served = _cut_off(bad, prompt)
    stats = stats_of(got)
    assert got["id"] in served and stats.prefill == "local", stats
    assert stats.kv_dtype == "q4/g32"
    want = oracle.reference(prompt, kv_bits=4, kv_group_size=32)
    assert want != oracle.reference(prompt)  # the 4-bit cache shows in this text
    assert got["choices"][0]["message"]["content"] == want


def _cut_off(bad: BadPeer, prompt: str) -> tuple[dict[str, Any], list[str]]:
    bad.set_mode("quantized_cut")
    try:
        body = {**chat_body(prompt), "tandem": {"kv_bits": 4, "kv_group_size": 32}}
        reply = post(bad.decode.url + "/v1/chat/completions", body, timeout=60)
        served = [c["request_id"] for c in bad.prefills()]
    finally:
        bad.set_mode("good")
    assert reply.status == 200, f"{reply}\n{bad.decode.output()[-3000:]}"
    return reply.json(), served


# --- 8: 503 with a useless Retry-After ----------------------------------------------------


@pytest.mark.parametrize("mode", ["503_zero", "503_nan"])
async def test_retry_after_zero_or_nan_is_floored_and_capped(
    bad: BadPeer, oracle: Oracle, mode: str
) -> None:
    prompt = f"A busy prefill node said {mode}; what now?"
    await asyncio.to_thread(bad.set_mode, mode)
    url = bad.decode.url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.time()
    async with aiohttp.ClientSession(headers=headers) as s:

        async def chat() -> tuple[int, dict[str, Any]]:
            async with s.post(url, json=chat_body(prompt)) as r:
                return r.status, await r.json(content_type=None)

        task = asyncio.create_task(chat())
        try:
            await asyncio.sleep(3.0)
            calls = await asyncio.to_thread(bad.prefills)
            in_3s = [c for c in calls if c["t"] < t0 + 3.0]
            assert len(in_3s) <= 8, f"{len(in_3s)} /v1/prefill calls in 3 s"
            status, body = await asyncio.wait_for(task, 30.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.to_thread(bad.set_mode, "good")
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == oracle.reference(prompt)
    assert stats_of(body).prefill == "local"


# --- 9: a frozen prefill node -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["freeze", "stall"], ids=["before-any-byte", "mid-stream"])
async def test_frozen_peer_aborts_once_unreachable(bad: BadPeer, oracle: Oracle, mode: str) -> None:
    """The peer stops (SIGSTOP) while it holds the request: its /health stops answering, the
    peer table marks it unreachable within 10 s, and the request falls back at once."""
    prompt = f"The prefill node froze ({mode}); answer anyway."
    await asyncio.to_thread(bad.set_mode, mode)
    url = bad.decode.url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.monotonic()
    try:
        async with (
            aiohttp.ClientSession(headers=headers) as s,
            asyncio.timeout(FROZEN_LIMIT_S),
            s.post(url, json=chat_body(prompt)) as r,
        ):
            status, body = r.status, await r.json(content_type=None)
    except TimeoutError:
        pytest.fail(f"no answer within {FROZEN_LIMIT_S} s of a frozen peer")
    finally:
        await asyncio.to_thread(bad.thaw)
    elapsed = time.monotonic() - t0
    assert status == 200, body
    assert elapsed < FROZEN_LIMIT_S
    assert body["choices"][0]["message"]["content"] == oracle.reference(prompt)
    assert stats_of(body).prefill == "local"
