"""A decode group's failures (issue 38): the prefill node killed mid-way (the group prefills
locally, pipelined across its ranks, and the answer is still mlx-lm's), then rank 1 killed
during a generation (the client gets an error within seconds, rank 0 answers 503 and exits by
itself, as it does when rank 1 is gone between requests: nothing hangs). What mlx.launch does
when a rank exits (it stops the others) is in test_decode_group.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import openai
import pytest
from tandem.nodes.contract.cluster import DecodeGroup
from tandem.nodes.contract.events import LayerEvent

from tests.conftest import MakeTiny
from tests.group_support import rank_pids, start_group, stop_ranks
from tests.nodeproc import start_node, stop_all, wait_healthy, wait_trusted
from tests.records import stats_of
from tests.test_handoff import Cluster, _chat
from tests.test_turns import TOKEN, _watch

pytestmark = pytest.mark.timeout(240)


async def test_prefill_killed_then_rank_1_killed(tiny_model: MakeTiny, tmp_path: Path) -> None:
    model = tiny_model(arch="llama", layers=4)
    prefill = start_node(tmp_path, model, "prefill", "--budget", "200KB", "--link-gbps", "0.004",
                         token=TOKEN, wait=False)  # fmt: skip
    decode = start_group(tmp_path, model, "--peer", prefill.url, "--remote-prefill", "always",
                         token=TOKEN)  # fmt: skip
    group = None
    try:
        await asyncio.to_thread(wait_healthy, prefill)
        await asyncio.to_thread(wait_healthy, decode)
        await asyncio.to_thread(wait_trusted, decode)
        group = Cluster(model, prefill, decode)
        await asyncio.sleep(1.5)  # the router's probe of the slow node
        prompt = "A story about sunflowers and a fence."
        landed = asyncio.Event()
        received = lambda rec: isinstance(rec, LayerEvent) and rec.state == "received"  # noqa: E731
        watcher = asyncio.create_task(_watch(decode, "chatcmpl-", landed, [], received))
        reply_task = asyncio.create_task(asyncio.to_thread(_chat, group.client(TOKEN), prompt))
        await asyncio.wait_for(landed.wait(), 60)  # layer 0 is in: on rank 1, sent on
        prefill.proc.send_signal(signal.SIGKILL)
        reply = await asyncio.wait_for(reply_task, 90)
        watcher.cancel()
        assert stats_of(reply).prefill == "local"
        assert reply.choices[0].message.content == group.reference(prompt)
        local = await asyncio.to_thread(_chat, group.client(TOKEN), "Why is the sky blue?")
        assert local.choices[0].message.content == group.reference("Why is the sky blue?")
        await _rank_1_killed(group)
    finally:
        stop_all([decode, prefill])
        stop_ranks(decode)


async def _rank_1_killed(group: Cluster) -> None:
    """Rank 1 killed while a stream is generating: the stream ends with an error within a
    few seconds, and rank 0 stops by itself (answering 503 until then)."""
    client = openai.OpenAI(base_url=group.decode.url + "/v1", api_key=TOKEN, max_retries=0)
    ranks = rank_pids(group.decode)
    assert set(ranks) == {0, 1}, group.decode.output()

    def generate() -> tuple[str, float]:
        stream = client.completions.create(
            model="m", prompt=[5, 17, 42], max_tokens=4000, temperature=0, stream=True
        )
        try:
            for n, _ in enumerate(stream):
                if n == 10:
                    killed_at[0] = time.monotonic()
                    ranks_now = rank_pids(group.decode)
                    os.kill(ranks_now[1], signal.SIGKILL)
        except openai.APIError as e:
            return str(e), time.monotonic()
        return "the stream ended without an error", time.monotonic()

    killed_at = [0.0]
    error, at = await asyncio.wait_for(asyncio.to_thread(generate), 60)
    assert "decode group" in error and "stopping" in error, error  # the 503's message
    assert at - killed_at[0] < 5
    t0 = time.monotonic()
    await asyncio.to_thread(group.decode.proc.wait, 20)  # rank 0 stopped itself
    assert time.monotonic() - t0 < 20
    assert not rank_pids(group.decode)
    assert "this node is stopping so that the group can be started again" in group.decode.output()


def test_no_rank_outlives_its_launcher(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """Issue 47 item 3: SIGTERM to `mlx.launch` (a closed terminal, a service stop): both
    ranks are gone within 5 s (they were re-parented to init and kept serving)."""
    model = tiny_model(arch="llama", layers=4)
    group = start_group(tmp_path, model, token=TOKEN, launcher=True)
    try:
        wait_healthy(group, timeout=90)
        assert len(rank_pids(group)) == 2
        group.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while rank_pids(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rank_pids(group) == {}, group.output()[-2000:]
    finally:
        stop_all([group])
        stop_ranks(group)


def test_a_frozen_rank_takes_the_group_down_within_seconds(
    tiny_model: MakeTiny, tmp_path: Path
) -> None:
    """Issue 47 item 1: rank 1 stopped (SIGSTOP: a hung Mac) mid-stream stops beating on its
    doorbell; within 10 s the stream ends with an error, rank 0 says so in `/health`, answers
    503 `group_broken`, and exits (it hung for good, a core busy in a collective rank 1 never
    joined)."""
    import urllib.error
    import urllib.request

    model = tiny_model(arch="llama", layers=4)
    group = start_group(tmp_path, model, token=TOKEN)
    ranks: dict[int, int] = {}
    try:
        wait_healthy(group, timeout=90)
        ranks = rank_pids(group)
        client = openai.OpenAI(base_url=group.url + "/v1", api_key=TOKEN, max_retries=0)
        stream = client.completions.create(
            model="m", prompt=[5, 17, 42], max_tokens=4000, temperature=0, stream=True
        )
        streamed, t0 = 0, 0.0
        with pytest.raises(openai.APIError, match="decode group"):  # the stream in flight
            for streamed, _ in enumerate(stream):
                if streamed == 5:
                    os.kill(ranks[1], signal.SIGSTOP)
                    t0 = time.monotonic()
        assert streamed >= 5 and time.monotonic() - t0 < 10
        refused, said = None, ""
        while time.monotonic() - t0 < 10 and group.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                said = said or (group.health().group or DecodeGroup(0, "", ())).lost
            req = urllib.request.Request(
                group.url + "/v1/chat/completions",
                data=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            try:
                urllib.request.urlopen(req, timeout=1).read()
            except urllib.error.HTTPError as e:
                refused = (e.code, e.read())
                break
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                pass  # the first chat waits in the frozen collective
            time.sleep(0.2)
        assert refused is not None and refused[0] == 503 and b"group_broken" in refused[1], (
            refused, group.output()[-2000:],
        )  # fmt: skip
        assert "stopped answering" in said, said
        assert group.proc.wait(timeout=10 - (time.monotonic() - t0) + 5) is not None
    finally:
        if 1 in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ranks[1], signal.SIGKILL)
        stop_all([group])
        stop_ranks(group)
