"""Multi-turn prompt cache through the handoff, failure fallback, and the `auto` router —
real node processes on loopback, mlx-lm as the oracle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from tandem.nodes.contract.events import Event, LinkEvent, RequestEvent
from tandem.nodes.contract.http import PROTO
from tandem.nodes.contract.prefix import common_prefix

from tests.fake_prefill import start_fake_prefill
from tests.nodeproc import NodeProc, remote_pair, start_node, wait_healthy, wait_trusted
from tests.records import event_of, stats_of

TOKEN = "turns-token-0123456789"


class Oracle:
    """mlx-lm greedy generation from scratch, with the generated token ids."""

    def __init__(self, model: Path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(model))

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def generate(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, list[int]]:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate

        text, ids = "", []
        for r in stream_generate(
            self.model, self.tokenizer, mx.array(self.tokens(messages)), max_tokens=max_tokens
        ):
            text += r.text
            ids.append(r.token)
        return text, ids


def _chat(node: NodeProc, messages: list[dict[str, str]], max_tokens: int = 16, **kw):
    client = openai.OpenAI(base_url=node.url + "/v1", api_key=TOKEN, timeout=120)
    return client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model(arch="llama", layers=4, shards=2, rope_scaling="llama3")


@pytest.fixture(scope="module")
def oracle(model: Path) -> Oracle:
    return Oracle(model)


@pytest.fixture
def pair(model: Path, tmp_path: Path) -> Iterator[tuple[NodeProc, NodeProc]]:
    with remote_pair(tmp_path, model, "200KB", TOKEN) as nodes:
        yield nodes


def test_turns_are_exact_and_prefill_only_new_tokens(
    pair: tuple[NodeProc, NodeProc], model: Path, oracle: Oracle, tmp_path: Path
) -> None:
    prefill, decode = pair
    messages = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]
    held: list[int] = []  # what the decode node's cache holds after each turn
    for turn, follow_up in enumerate(
        ["Why did he count the waves?", "What was in the blue notebook?", "Goodbye!"]
    ):
        if turn == 2:  # restart the prefill node on the same port: its prefix cache is cold
            prefill.stop()
            prefill = start_node(
                tmp_path, model, "prefill", "--budget", "200KB", token=TOKEN, port=prefill.port
            )
            time.sleep(2.5)  # one health-check round
            wait_trusted(decode)
        want, ids = oracle.generate(messages, 16)
        tokens = oracle.tokens(messages)
        reply = _chat(decode, messages)
        stats = stats_of(reply)
        assert reply.choices[0].message.content == want, f"turn {turn}"
        assert stats.prefill == "remote"
        k = min(common_prefix(tokens, held), len(tokens) - 1)
        assert stats.prefill_tokens == len(tokens) - 1 - k, f"turn {turn}"
        if turn:
            assert k >= len(oracle.tokens(messages[:-2])), "the last turn's prompt was reused"
        held = tokens + ids
        messages += [{"role": "assistant", "content": want}, {"role": "user", "content": follow_up}]
    prefill.stop()


def _net_in(rec: Event) -> bool:
    return isinstance(rec, LinkEvent) and rec.name == "net_in"


async def _watch(
    node: NodeProc, rid_prefix: str, stop: asyncio.Event, seen: list[Event],
    when: Callable[[Event], bool] = _net_in,
) -> None:  # fmt: skip
    """The node's events of requests `rid_prefix`... into `seen`; `stop` set at the first
    one `when` picks (the first KV bytes in, by default)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{node.url}/v1/events?since={time.time() - 1}"
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        async for line in r.content:
            rec = event_of(line)
            if rec is not None and rec.request_id.startswith(rid_prefix):
                seen.append(rec)
                if when(rec):
                    stop.set()


async def test_prefill_node_killed_mid_stream(model: Path, oracle: Oracle, tmp_path: Path) -> None:
    with remote_pair(tmp_path, model, "200KB", TOKEN, "--link-gbps", "0.004") as (prefill, decode):
        await asyncio.sleep(1.5)  # let the router's probe of the slow node finish
        messages = [{"role": "user", "content": "A story about sunflowers and a fence."}]
        first_net_in, seen = asyncio.Event(), []
        watcher = asyncio.create_task(_watch(decode, "chatcmpl-", first_net_in, seen))
        reply_task = asyncio.create_task(asyncio.to_thread(_chat, decode, messages))
        await asyncio.wait_for(first_net_in.wait(), 30)
        prefill.proc.send_signal(signal.SIGKILL)
        reply = await asyncio.wait_for(reply_task, 60)
        await asyncio.sleep(0.2)
        watcher.cancel()
        want, _ = oracle.generate(messages, 16)
        assert reply.choices[0].message.content == want
        assert stats_of(reply).prefill == "local"
        failed = [r for r in seen if isinstance(r, RequestEvent) and r.phase == "failed"]
        assert failed and failed[0].request_id == reply.id


async def test_fallback_on_every_kind_of_failure(
    model: Path, oracle: Oracle, tmp_path: Path
) -> None:
    fake = await start_fake_prefill(model, TOKEN, "503")
    decode = start_node(
        tmp_path, model, "decode", "--peer", fake.url, "--remote-prefill", "always",
        "--remote-timeout", "3", token=TOKEN,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_trusted, decode)
        for i, mode in enumerate(["503", "409", "error_frame", "garbage", "die", "hang"]):
            fake.mode = mode
            messages = [{"role": "user", "content": f"Question number {i}: why is the sky blue?"}]
            reply = await asyncio.to_thread(_chat, decode, messages)
            want, _ = oracle.generate(messages, 16)
            assert reply.choices[0].message.content == want, mode
            assert stats_of(reply).prefill == "local", mode
            assert reply.id in fake.prefills, mode
        events = await _request_events(decode)
        failed = {r.request_id: r.detail for r in events if r.phase == "failed"}
        assert len(failed) >= 6
        assert any("503" in d for d in failed.values())
        assert any("409" in d for d in failed.values())
        assert any("out of memory" in d for d in failed.values())
    finally:
        decode.stop()
        await fake.close()


async def _request_events(node: NodeProc) -> list[RequestEvent]:
    records: list[RequestEvent] = []
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def read() -> None:
        url = f"{node.url}/v1/events?since=0"
        async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
            async for line in r.content:
                if isinstance(rec := event_of(line), RequestEvent):
                    records.append(rec)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(read(), 2)
    return records


# its busy requests are asked again for ~5 s: a prefill slowed by another worker outlasts that
@pytest.mark.serial
async def test_full_queue_answers_503_and_the_decode_node_retries(
    model: Path, oracle: Oracle, tmp_path: Path
) -> None:
    slow = ("--link-gbps", "0.01", "--queue-limit", "1")
    with remote_pair(tmp_path, model, "200KB", TOKEN, *slow) as (prefill, decode):
        await asyncio.sleep(2.0)  # the router's start-up probe of the prefill node
        asks = [[{"role": "user", "content": f"Story {i}: a garden with sunflowers."}]
                for i in range(3)]  # fmt: skip
        replies = await asyncio.gather(*(asyncio.to_thread(_chat, decode, m) for m in asks))
        for messages, reply in zip(asks, replies, strict=True):
            assert reply.choices[0].message.content == oracle.generate(messages, 16)[0]
            assert stats_of(reply).prefill == "remote"
        refused = [r for r in await _request_events(prefill) if r.phase == "failed"]
        assert refused and all("503" in r.detail for r in refused)
        import urllib.error
        import urllib.request

        from tandem.nodes.model import fingerprint, load_index

        body = {"proto": PROTO, "fingerprint": fingerprint(load_index(model)),
                "tokens": list(range(40)), "start": 0}  # fmt: skip

        def post() -> tuple[int, str | None]:
            req = urllib.request.Request(
                prefill.url + "/v1/prefill", data=json.dumps(body).encode(), method="POST",
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                    return r.status, None
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("Retry-After")

        results = await asyncio.gather(*(asyncio.to_thread(post) for _ in range(3)))
        assert (503, "1") in results and (200, None) in results


@pytest.fixture(scope="module")
def mid_model(tiny_model) -> Path:
    """Big enough that mlx's reference BLAS is far slower than torch at prefill."""
    return tiny_model(arch="llama", layers=4, hidden=384, heads=6, kv_heads=2,
                      intermediate=1024, vocab=1024)  # fmt: skip


@contextlib.contextmanager
def _peered(tmp: Path, model: Path) -> Iterator[tuple[NodeProc, NodeProc]]:
    """A prefill node and a decode node with it as its peer (where to prefill is the router's
    choice), once the decode node trusts it; both stopped on exit."""
    prefill = start_node(tmp, model, "prefill", token=TOKEN, wait=False)
    decode = start_node(tmp, model, "decode", "--peer", prefill.url, token=TOKEN)
    try:
        wait_healthy(prefill)
        wait_trusted(decode)
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def test_auto_router_end_to_end(mid_model: Path, tmp_path: Path) -> None:
    with _peered(tmp_path, mid_model) as (_, decode):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the router's start-up probe of the peer
            peers = decode.cluster().peers
            if peers and peers[0].prefill_floor_s is not None:
                break
            time.sleep(0.2)
        client = openai.OpenAI(base_url=decode.url + "/v1", api_key=TOKEN, timeout=300)
        long_prompt = " ".join(f"word{i % 97} and more text" for i in range(300))
        long = client.completions.create(model="m", prompt=long_prompt, max_tokens=2)
        assert stats_of(long).prefill == "remote"
        short = client.completions.create(model="m", prompt="Hello! How are you", max_tokens=2)
        assert short.usage.prompt_tokens == 5
        assert stats_of(short).prefill == "local"
        cluster = decode.cluster()
        assert cluster.peers[0].prefill_tok_s or cluster.peers[0].link_Bps


def test_restarted_prefill_node_is_trusted_again(model: Path, tmp_path: Path) -> None:
    with _peered(tmp_path, model) as (prefill, decode):
        prefill.stop()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            peer = decode.cluster().peers[0]
            if peer.reason == "unreachable":
                break
            time.sleep(0.2)
        assert peer.reason == "unreachable" and not peer.trusted
        restarted = start_node(tmp_path, model, "prefill", token=TOKEN, port=prefill.port)
        try:
            wait_healthy(restarted)
            wait_trusted(decode)
        finally:
            restarted.stop()
