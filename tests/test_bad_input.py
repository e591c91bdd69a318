"""Acceptance of issue 18's bad-input list, black box: real node processes on loopback, raw
HTTP, and mlx-lm itself as the oracle.

Every bad request gets a 4xx with the one error body `{"error": {"message", "type", "code"}}`,
never a 5xx, and a full decode node answers 503 with a `Retry-After`. A misbehaving prefill
peer is tested in `test_bad_input_peer.py`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tandem.nodes.contract.events import RequestEvent
from tandem.nodes.contract.http import PROTO

from tests import bad_input_fixtures
from tests.bad_input_support import (
    TOKEN,
    Oracle,
    Reply,
    assert_error,
    chat_body,
    error_problem,
    events_since,
    post,
    status_only,
)
from tests.nodeproc import NodeProc, remote_pair, start_node

DEEP = 100_000
DEEP_ARRAY = "[" * DEEP + "]" * DEEP
DEEP_OBJECT = '{"a":' * DEEP + "1" + "}" * DEEP


llama = bad_input_fixtures.llama  # module-scoped: the model and mlx-lm as its oracle
oracle = bad_input_fixtures.oracle


@dataclass
class Pair:
    prefill: NodeProc
    decode: NodeProc
    fingerprint: str

    def chat(self, body: bytes | str | dict[str, Any], timeout: float = 30) -> Reply:
        return post(self.decode.url + "/v1/chat/completions", body, timeout=timeout)


@pytest.fixture(scope="module")
def pair(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A real prefill node and a decode node that always prefills on it."""
    with remote_pair(tmp_path_factory.mktemp("pair"), llama, "64MiB", TOKEN) as (p, d):
        yield Pair(p, d, p.health().fingerprint)


# --- 1, 2: bodies the JSON parser or the tokenizer chokes on ------------------------------


def _routes(pair: Pair) -> dict[str, str]:
    return {
        "chat": pair.decode.url + "/v1/chat/completions",
        "completions": pair.decode.url + "/v1/completions",
        "prefill": pair.prefill.url + "/v1/prefill",
        "hello-decode": pair.decode.url + "/v1/hello",
        "hello-prefill": pair.prefill.url + "/v1/hello",
    }


def _asking(route: str, text: str) -> dict[str, Any]:
    """A body that asks `text` on `route`: one user message (chat) or the prompt."""
    return (
        {"messages": [{"role": "user", "content": text}]} if route == "chat" else {"prompt": text}
    )


DEEP_BODIES = {
    "chat": [
        DEEP_ARRAY,
        DEEP_OBJECT,
        '{"messages": [{"role": "user", "content": ' + DEEP_OBJECT + "}]}",
        '{"messages": ' + DEEP_ARRAY + "}",
    ],
    "completions": [DEEP_ARRAY, DEEP_OBJECT, '{"prompt": ' + DEEP_ARRAY + ', "max_tokens": 4}'],
    "prefill": [DEEP_ARRAY, DEEP_OBJECT, '{"proto": 1, "tokens": ' + DEEP_ARRAY + "}"],
    "hello-decode": [DEEP_ARRAY, '{"nonce": ' + DEEP_OBJECT + ', "id": "x"}'],
    "hello-prefill": [DEEP_ARRAY, '{"nonce": "0123456789abcdef", "id": ' + DEEP_ARRAY + "}"],
}


@pytest.mark.parametrize("route", list(DEEP_BODIES))
def test_deep_json_is_400(pair: Pair, route: str) -> None:
    url = _routes(pair)[route]
    # the hello takes a few KiB (issue 47): a longer body is refused for its size first
    statuses = (400, 413) if route.startswith("hello") else (400,)
    problems = [
        f"body {i}: {p}"
        for i, body in enumerate(DEEP_BODIES[route])
        if (p := error_problem(post(url, body), statuses)) is not None
    ]
    assert not problems, problems


SURROGATE_BODIES = {  # raw JSON text: "\ud800" is a lone surrogate once parsed
    "chat-content": ("chat", r'{"messages":[{"role":"user","content":"\ud800"}],"max_tokens":4}'),
    "chat-content-mixed": (
        "chat",
        r'{"messages":[{"role":"user","content":"hi \udfff there"}],"max_tokens":4}',
    ),
    "chat-role": ("chat", r'{"messages":[{"role":"\ud800","content":"hi"}],"max_tokens":4}'),
    "completions-prompt": ("completions", r'{"prompt":"\ud800","max_tokens":4}'),
    "hello-nonce": (
        "hello-decode",
        r'{"nonce":"\ud800\ud800\ud800\ud800\ud800\ud800\ud800\ud800","id":"x"}',
    ),
    "hello-id": ("hello-prefill", r'{"nonce":"0123456789abcdef","id":"\ud800"}'),
}


@pytest.mark.parametrize("case", list(SURROGATE_BODIES))
def test_lone_surrogate_is_400(pair: Pair, case: str) -> None:
    route, body = SURROGATE_BODIES[case]
    assert_error(post(_routes(pair)[route], body))


def test_oversized_body_is_413_json(pair: Pair) -> None:
    """Past the node's 1 MiB body limit every route answers a JSON 413 (aiohttp's own 413 is
    text/plain)."""
    big = json.dumps({"tokens": [1] * 400_000, "messages": [], "prompt": "", "nonce": ""})
    problems = {
        r: p for r, url in _routes(pair).items() if (p := error_problem(post(url, big), (413,)))
    }
    assert not problems, problems


# --- 3, 4, 6: fields the OpenAI API and /v1/prefill must refuse ---------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
@pytest.mark.parametrize("seed", [-1, 2**64])
def test_bad_seed_is_400_before_any_prefill(pair: Pair, seed: int, stream: bool) -> None:
    t0 = time.time()
    reply = pair.chat(chat_body(f"Seeded story {seed}, {stream}.", seed=seed, stream=stream))
    assert_error(reply)
    # the router's calibration probes (`probe-…`) may run at any time: they are not this request
    prefill_side = [
        r for r in events_since(pair.prefill, t0)
        if isinstance(r, RequestEvent) and not r.request_id.startswith("probe-")
    ]  # fmt: skip
    assert not prefill_side, f"the prefill node ran: {prefill_side}"
    started = [
        r for r in events_since(pair.decode, t0)
        if isinstance(r, RequestEvent) and r.phase == "prefill_start"
        and not r.request_id.startswith("probe-")
    ]  # fmt: skip
    assert not started, started


@pytest.mark.parametrize(
    "field", [{"max_tokens": 0}, {"max_tokens": False}, {"max_completion_tokens": 0}]
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_max_tokens_zero_or_false_is_400(pair: Pair, route: str, field: dict[str, Any]) -> None:
    body = _asking(route, "Count to ten.")
    reply = post(_routes(pair)[route], {**body, "temperature": 0, **field})
    assert_error(reply)


@pytest.mark.parametrize(
    "field",
    [
        {"stream": "false"},
        {"stream": "true"},
        {"n": 2},
        {"n": 0},
        {"n": True},
    ],
    ids=["stream-false-string", "stream-true-string", "n-2", "n-0", "n-true"],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_bad_stream_or_n_is_400(pair: Pair, route: str, field: dict[str, Any]) -> None:
    body = _asking(route, "Say hi.")
    reply = post(_routes(pair)[route], {**body, "max_tokens": 4, "temperature": 0, **field})
    assert_error(reply)


def test_n_one_still_works(pair: Pair, oracle: Oracle) -> None:
    prompt = "What does n equal one mean?"
    reply = pair.chat(chat_body(prompt, n=1))
    assert reply.status == 200, reply
    choices = reply.json()["choices"]
    assert len(choices) == 1
    assert choices[0]["message"]["content"] == oracle.reference(prompt)


@pytest.mark.parametrize(
    "proto", [PROTO - 1, PROTO + 1, True, float(PROTO), str(PROTO)],
    ids=["old", "newer", "true", "float", "string"],
)  # fmt: skip
def test_prefill_proto_must_be_the_integer_proto(pair: Pair, proto: object) -> None:
    """An old-protocol peer (proto 1: no quantized KV) is refused with a reason it can read."""
    body = {"proto": proto, "fingerprint": pair.fingerprint, "request_id": "proto-check",
            "tokens": [1, 2, 3, 4], "start": 0}  # fmt: skip
    reply = status_only(pair.prefill.url + "/v1/prefill", body)
    assert_error(reply)
    error = reply.json()["error"]
    assert error["code"] == "protocol_mismatch" and f"proto must be {PROTO}" in error["message"]


# --- 5: the prefill node enforces the model's context -------------------------------------


def test_prefill_beyond_the_context_is_refused_as_json(pair: Pair, oracle: Oracle) -> None:
    context = oracle.config["max_position_embeddings"]
    n = max(20_000, context + 1)
    vocab = oracle.config["vocab_size"]
    body = {"proto": PROTO, "fingerprint": pair.fingerprint, "request_id": "too-long",
            "tokens": [(7 * i + 3) % vocab for i in range(n)], "start": 0}  # fmt: skip
    assert_error(status_only(pair.prefill.url + "/v1/prefill", body), (400, 413))


# --- 10: admission control on the decode node ---------------------------------------------


async def test_admission_control_503_with_retry_after(llama: Path, tmp_path: Path) -> None:
    node = await asyncio.to_thread(
        start_node, tmp_path, llama, "decode", "--remote-prefill", "never",
        "--max-concurrent", "1", "--max-queue", "1", token=TOKEN,
    )  # fmt: skip
    try:
        url = node.url + "/v1/chat/completions"
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as s:

            async def chat(i: int) -> Reply:
                body = chat_body(f"Long story number {i}, please.", max_tokens=400)
                async with s.post(url, json=body) as r:
                    return Reply(r.status, {k.lower(): v for k, v in r.headers.items()},
                                 await r.read())  # fmt: skip

            replies = await asyncio.gather(*(chat(i) for i in range(6)))
    finally:
        node.stop()
    refused = [r for r in replies if r.status == 503]
    assert refused, [str(r) for r in replies]
    for r in refused:
        assert_error(r, (503,))
        assert float(r.headers["retry-after"]) > 0, r.headers
    assert all(r.status == 200 for r in replies if r.status != 503), [str(r) for r in replies]
    assert len(refused) <= 4  # one runs and one waits


# --- 11: generated bodies: never a 5xx, always JSON ---------------------------------------

FP_PLACEHOLDER = "<the model's fingerprint>"
DELETE = "<delete this key>"
VOCAB = 512  # the tiny model's (MakeModelArgs' default)
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates too
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=24)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | TEXT, "content": TEXT}
)
SAMPLING = {
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "stop": st.lists(TEXT, max_size=4) | TEXT,
    "seed": st.integers(),
    "stream": st.booleans(),
    "n": st.just(1),
}
VALID = {  # well-formed requests (up to the values inside them)
    "chat": st.fixed_dictionaries(
        {"messages": st.lists(MESSAGE, min_size=1, max_size=3)}, optional=SAMPLING
    ),
    "completions": st.fixed_dictionaries(
        {"prompt": st.text(st.characters(exclude_categories=()), min_size=1) | TOKEN_IDS},
        optional=SAMPLING,
    ),
    "prefill": st.fixed_dictionaries(
        {"proto": st.just(1), "fingerprint": st.just(FP_PLACEHOLDER), "tokens": TOKEN_IDS},
        optional={"request_id": TEXT, "start": st.integers(0, 1)},
    ),
    "hello": st.fixed_dictionaries({"nonce": st.text(min_size=8, max_size=64), "id": TEXT}),
}
KEYS = sorted({"messages", "prompt", "tokens", "start", "proto", "fingerprint", "request_id",
               "nonce", "id", *SAMPLING})  # fmt: skip
MUTATIONS = st.dictionaries(st.sampled_from(KEYS), JSON | st.just(DELETE), min_size=1, max_size=2)


def _mutated(body: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`body` with one or two keys set to arbitrary JSON (or removed)."""
    out = {**body, **changes}
    return {k: v for k, v in out.items() if v != DELETE}


def bodies(route: str) -> st.SearchStrategy[object]:
    """Any JSON; a well-formed request; or one with a key or two gone wrong."""
    return JSON | VALID[route] | st.builds(_mutated, VALID[route], MUTATIONS)


def _bounded(body: object, fingerprint: str) -> object:
    """The body with the real fingerprint put in, and a small `max_tokens` wherever a valid
    request would otherwise decode its default 256 tokens or more."""
    if not isinstance(body, dict):
        return body
    body = {**body}
    if body.get("fingerprint") == FP_PLACEHOLDER:
        body["fingerprint"] = fingerprint
    max_tokens = body.get("max_tokens")
    if "max_tokens" not in body or (type(max_tokens) is int and max_tokens > 4):
        body["max_tokens"] = 3
    return body


def _fuzz_problem(reply: Reply, body: object) -> str | None:
    if reply.status >= 500:
        return f"5xx: {reply}"
    if reply.status >= 400:
        return error_problem(reply, (reply.status,))
    streamed = isinstance(body, dict) and body.get("stream") is True
    if reply.content_type == "text/event-stream" and streamed:
        return None if reply.body.rstrip().endswith(b"data: [DONE]") else f"cut stream: {reply}"
    if reply.content_type == "application/x-tandem-kv":
        return None  # a valid /v1/prefill request: a KV stream
    if reply.content_type != "application/json":
        return f"200 that is not JSON: {reply}"
    try:
        reply.json()
    except ValueError:
        return f"200 whose body does not parse: {reply}"
    return None


@pytest.mark.parametrize("route", list(VALID))
def test_generated_bodies_never_5xx(pair: Pair, oracle: Oracle, route: str) -> None:
    assert oracle.config["vocab_size"] == VOCAB
    url = {**_routes(pair), "hello": pair.prefill.url + "/v1/hello"}[route]

    @settings(
        max_examples=60, deadline=None, database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: it would take minutes
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )  # fmt: skip
    @given(body=bodies(route))
    def one(body: object) -> None:
        body = _bounded(body, pair.fingerprint)
        text = json.dumps(body)  # surrogates travel escaped, as any JSON client sends them
        try:
            reply = post(url, text, timeout=20)
        except (OSError, http.client.HTTPException) as e:  # a dropped or cut reply
            pytest.fail(f"{type(e).__name__}: {e}\nbody: {text[:300]}")
        problem = _fuzz_problem(reply, body)
        assert problem is None, f"{problem}\nbody: {text[:300]}"

    one()
    prompt = f"After the {route} fuzz, one exact answer."
    reply = pair.chat(chat_body(prompt))
    assert reply.status == 200, reply
    assert reply.json()["choices"][0]["message"]["content"] == oracle.reference(prompt)
