"""Acceptance of the KV handoff: real prefill and decode node processes on loopback, the real
`openai` client, and mlx-lm itself as the oracle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.events import Event, LayerEvent, LinkEvent, RequestEvent
from tandem.nodes.contract.http import PROTO
from tandem.nodes.model import load_index

from tests.fake_prefill import start_fake_prefill
from tests.hide_modules import hidden_env
from tests.nodeproc import NodeProc, remote_pair, start_node, wait_trusted
from tests.records import event_of, stats_of

TOKEN = "test-token-0123456789"
PROMPTS = [
    "Tell me a story about a lighthouse keeper who counted the waves.",
    "Why is the sky blue?",
    "Hello! How are you today?",
    "The train left the station at seven, crossed the river at eight.",
]
MAX_TOKENS = 24


class Cluster:
    def __init__(self, model: Path, prefill: NodeProc, decode: NodeProc) -> None:
        self.model, self.prefill, self.decode = model, prefill, decode
        from mlx_lm import load

        self.mlx_model, self.tokenizer = load(str(model))

    def client(self, token: str | None = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.decode.url + "/v1", api_key=token or "none")

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.decode.url + "/v1", api_key=TOKEN)

    def chat_tokens(self, prompt: str) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        )

    def reference(self, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        """mlx-lm greedy generation from scratch on the same chat-templated prompt."""
        from mlx_lm import generate

        return generate(
            self.mlx_model, self.tokenizer, self.chat_tokens(prompt), max_tokens=max_tokens
        )


def _cluster(tmp: Path, model: Path) -> Iterator[Cluster]:
    with remote_pair(tmp, model, "200KB", TOKEN) as (prefill, decode):
        yield Cluster(model, prefill, decode)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def cluster(request, tiny_model, tmp_path_factory) -> Iterator[Cluster]:
    kw = {"rope_scaling": "llama3"} if request.param == "llama" else {}
    model = tiny_model(arch=request.param, layers=4, shards=2, **kw)
    yield from _cluster(tmp_path_factory.mktemp(request.param), model)


def _chat(client: openai.OpenAI, prompt: str, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=0, **kw,
    )  # fmt: skip


def test_remote_chat_is_exactly_mlx_greedy(cluster: Cluster) -> None:
    for prompt in PROMPTS[:2]:
        reply = _chat(cluster.client(), prompt)
        stats = stats_of(reply)
        assert stats.prefill == "remote", cluster.decode.output()
        assert stats.prefill_node == cluster.prefill.url
        # the decode node's prompt cache may already hold the chat template's first tokens
        assert 0 < stats.prefill_tokens <= len(cluster.chat_tokens(prompt)) - 1
        assert reply.choices[0].message.content == cluster.reference(prompt)
        assert reply.usage.prompt_tokens == len(cluster.chat_tokens(prompt))


def test_streamed_equals_non_streamed(cluster: Cluster) -> None:
    prompt = PROMPTS[2]
    chunks = list(_chat(cluster.client(), prompt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert stats_of(last).prefill == "remote"
    # the same prompt again, not streamed: its whole prompt is now in the decode node's cache
    again = _chat(cluster.client(), prompt)
    assert stats_of(again).prefill_tokens == 0
    assert text == again.choices[0].message.content == cluster.reference(prompt)


def test_completions_endpoint(cluster: Cluster) -> None:
    from mlx_lm import generate

    prompt = "The quick brown fox"
    reply = cluster.client().completions.create(
        model="m", prompt=prompt, max_tokens=12, temperature=0
    )
    want = generate(cluster.mlx_model, cluster.tokenizer, prompt, max_tokens=12)
    assert reply.choices[0].text == want
    assert stats_of(reply).prefill == "remote"
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [cluster.model.name]


async def _events(node: NodeProc, rid: str, until: str = "done") -> list[Event]:
    """The node's events for one request, replayed from its ring."""
    records: list[Event] = []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{node.url}/v1/events?since=0"
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        async for line in r.content:
            rec = event_of(line)
            if rec is not None and rec.request_id == rid:
                records.append(rec)
                if isinstance(rec, RequestEvent) and rec.phase == until:
                    return records
    return records


async def test_kv_really_travels(cluster: Cluster) -> None:
    prompt = PROMPTS[3]
    reply = _chat(cluster.client(), prompt)
    stats = stats_of(reply)
    spec = load_index(cluster.model).spec
    n = len(cluster.chat_tokens(prompt))
    sent = stats.prefill_tokens  # n - 1 less what the decode node's prompt cache held
    assert 0 < sent <= n - 1
    kv = 2 * spec.num_layers * spec.num_kv_heads * sent * spec.head_dim * 4
    records = await asyncio.wait_for(_events(cluster.decode, reply.id), 10)
    net_in = [r for r in records if isinstance(r, LinkEvent) and r.name == "net_in"]
    received = [r.layer for r in records if isinstance(r, LayerEvent) and r.state == "received"]
    assert received == list(range(spec.num_layers))
    total = sum(r.bytes for r in net_in)
    assert len(net_in) == spec.num_layers
    overhead = total - kv  # per layer: the 9-byte frame prefix plus a small safetensors header
    assert 0 < overhead <= spec.num_layers * 512
    assert stats.kv_bytes >= total
    assert stats.kv_bytes - total < 1024  # plus only the header and done frames


@pytest.fixture(scope="module")
def llama(tiny_model) -> Path:
    return tiny_model(arch="llama", layers=4, shards=2, rope_scaling="llama3")


async def test_zeroed_kv_changes_the_output(llama: Path, tmp_path: Path) -> None:
    fake = await start_fake_prefill(llama, TOKEN, "zeros")
    decode = start_node(
        tmp_path, llama, "decode", "--peer", fake.url, "--remote-prefill", "always", token=TOKEN
    )
    try:
        await asyncio.to_thread(wait_trusted, decode)
        client = openai.AsyncOpenAI(base_url=decode.url + "/v1", api_key=TOKEN)
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=MAX_TOKENS, temperature=0,
        )  # fmt: skip
        assert stats_of(reply).prefill == "remote"
        assert reply.id in fake.prefills
        from mlx_lm import generate, load

        model, tok = load(str(llama))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True
        )
        assert reply.choices[0].message.content != generate(model, tok, prompt, max_tokens=24)
    finally:
        decode.stop()
        await fake.close()


async def test_missing_or_wrong_token_is_401(cluster: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}):
            for url in (cluster.decode.url, cluster.prefill.url):
                async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 401
            async with s.post(cluster.prefill.url + "/v1/prefill", json={}, headers=headers) as r:
                assert r.status == 401
            async with s.get(cluster.decode.url + "/v1/events", headers=headers) as r:
                assert r.status == 401
        async with s.get(cluster.decode.url + "/health") as r:
            assert r.status == 200
            assert TOKEN not in await r.text()
    wrong = openai.OpenAI(base_url=cluster.decode.url + "/v1", api_key="wrong-token")
    with pytest.raises(openai.AuthenticationError):
        _chat(wrong, "hi")


async def test_junk_and_bad_json_then_still_serving(cluster: Cluster) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    junk = os.urandom(2 * 1024 * 1024)
    async with aiohttp.ClientSession(headers=headers) as s:
        for url in (
            cluster.decode.url + "/v1/chat/completions",
            cluster.prefill.url + "/v1/prefill",
        ):
            async with s.post(url, data=junk) as r:
                assert 400 <= r.status < 500
        async with s.post(cluster.decode.url + "/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            assert "error" in await r.json()
        bad = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}
        async with s.post(cluster.decode.url + "/v1/chat/completions", json=bad) as r:
            assert r.status == 400
        huge = {"messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 8}
        async with s.post(cluster.decode.url + "/v1/chat/completions", json=huge) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "context_length_exceeded"
        async with s.post(cluster.prefill.url + "/v1/prefill", json={"proto": PROTO}) as r:
            assert r.status in (400, 409)
    reply = await asyncio.to_thread(_chat, cluster.client(), PROMPTS[1])
    assert reply.choices[0].message.content == cluster.reference(PROMPTS[1])


async def test_twenty_concurrent_requests_are_exact(cluster: Cluster) -> None:
    client = cluster.aclient()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(20)]
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": p}],
                max_tokens=12,
                temperature=0,
            )
            for p in prompts
        )
    )
    want = {p: cluster.reference(p, 12) for p in set(prompts)}
    for p, r in zip(prompts, replies, strict=True):
        assert r.choices[0].message.content == want[p]
        stats = stats_of(r)  # a repeated prompt may be wholly in the prompt cache
        assert stats.prefill == "remote" or stats.prefill_tokens == 0


def test_prefill_fingerprint_mismatch_is_409(cluster: Cluster) -> None:
    import urllib.error
    import urllib.request

    body = json.dumps(PrefillBody("0" * 64, "mismatch", [1, 2]).to_json())
    req = urllib.request.Request(
        cluster.prefill.url + "/v1/prefill", data=body.encode(), method="POST",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 409


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown(llama: Path, tmp_path: Path, sig: int) -> None:
    node = start_node(tmp_path, llama, "both", token=TOKEN)
    assert node.stop(sig, timeout=15) == 0
    assert "shutting down" in node.output()
    assert "Traceback" not in node.output()


def test_non_loopback_host_needs_a_token(llama: Path, tmp_path: Path) -> None:
    node = start_node(tmp_path, llama, "decode", "--host", "0.0.0.0", wait=False)
    assert node.proc.wait(60) == 2
    out = node.output()
    assert "without a token" in out and "Traceback" not in out


def test_decode_without_torch_and_prefill_without_mlx(llama: Path, tmp_path: Path) -> None:
    prefill = start_node(
        tmp_path, llama, "prefill", token=TOKEN, env=hidden_env(tmp_path, ["mlx", "mlx_lm"])
    )
    decode = start_node(
        tmp_path, llama, "decode", "--peer", prefill.url, "--remote-prefill", "always",
        token=TOKEN, env=hidden_env(tmp_path, ["torch"]),
    )  # fmt: skip
    try:
        wait_trusted(decode)
        client = openai.OpenAI(base_url=decode.url + "/v1", api_key=TOKEN)
        reply = _chat(client, PROMPTS[0])
        assert stats_of(reply).prefill == "remote"
        assert reply.choices[0].message.content
    finally:
        decode.stop()
        prefill.stop()
    assert "No module named" not in decode.output() + prefill.output()


def test_hidden_modules_really_hide(tmp_path: Path) -> None:
    import subprocess

    env = {**os.environ, **hidden_env(tmp_path, ["torch"])}
    code = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
