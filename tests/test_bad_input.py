"""Acceptance of issue 18's bad-input list, black box: real node processes on loopback, raw
HTTP, and mlx-lm itself as the oracle.

Every bad request gets a 4xx with the one error body `{"error": {"message", "type", "code"}}`,
never a 5xx; a trusted prefill node whose frames disagree with the model, that answers 503
with a useless `Retry-After`, or that freezes, costs the client nothing but time: the decode
node falls back to a local prefill and answers exactly what mlx-lm would.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tandem.nodes.contract.http import PROTO

from tests.bad_prefill import MODES
from tests.nodeproc import (
    ROOT,
    NodeProc,
    free_port,
    remote_pair,
    start_node,
    wait_healthy,
    wait_trusted,
)

TOKEN = "bad-input-token-0123456789"
MAX_TOKENS = 12
DEEP = 100_000
DEEP_ARRAY = "[" * DEEP + "]" * DEEP
DEEP_OBJECT = '{"a":' * DEEP + "1" + "}" * DEEP
FROZEN_LIMIT_S = 20.0  # a frozen peer must cost well under its 60 s read timeout


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()

    def json(self) -> Any:
        return json.loads(self.body)

    def __str__(self) -> str:
        return f"{self.status} {self.content_type} {self.body[:200]!r}"


def post(
    url: str, body: bytes | str | dict[str, Any], token: str | None = TOKEN, timeout: float = 30
) -> Reply:
    """POST `body` (a dict goes as JSON, text as its UTF-8 bytes) and read the whole reply."""
    if isinstance(body, dict):
        body = json.dumps(body)
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def status_only(url: str, body: dict[str, Any], timeout: float = 30) -> Reply:
    """POST and read just the status and headers (a 200 KV stream is not read)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, b"")
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def error_problem(reply: Reply, statuses: tuple[int, ...] = (400,)) -> str | None:
    """What is wrong with `reply` as the answer to a bad request (None: nothing)."""
    if reply.status not in statuses:
        return f"want {statuses}, got {reply}"
    if reply.content_type != "application/json":
        return f"error body is not JSON: {reply}"
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"no error object: {reply}"
    if not isinstance(error, dict) or not {"message", "type", "code"} <= error.keys():
        return f"error lacks message/type/code: {reply}"
    if not isinstance(error["message"], str):
        return f"error message is not a string: {reply}"
    return None


def assert_error(reply: Reply, statuses: tuple[int, ...] = (400,)) -> None:
    problem = error_problem(reply, statuses)
    assert problem is None, problem


def events_since(node: NodeProc, since: float, idle_s: float = 1.0) -> list[dict[str, Any]]:
    """The node's event records newer than `since`: its ring replayed, then whatever arrives
    until nothing has for `idle_s`."""
    req = urllib.request.Request(f"{node.url}/v1/events?since={since}")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    records: list[dict[str, Any]] = []
    try:
        with urllib.request.urlopen(req, timeout=idle_s) as r:
            for line in r:
                if line.startswith(b"data: "):
                    records.append(json.loads(line[6:]))
    except TimeoutError:
        pass
    return records


class Oracle:
    """mlx-lm greedy generation from scratch: what every answer must equal."""

    def __init__(self, model: Path) -> None:
        from mlx_lm import load

        self.model_dir = model
        self.model, self.tokenizer = load(str(model))
        self.config = json.loads((model / "config.json").read_text())

    def chat_tokens(self, prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def reference(self, prompt: str, max_tokens: int = MAX_TOKENS, **kv: int) -> str:
        """`kv`: mlx-lm's `kv_bits` and `kv_group_size` (its cache quantized after the prompt)."""
        from mlx_lm import generate

        tokens = self.chat_tokens(prompt)
        quantized = {"quantized_kv_start": 0, **kv} if kv else {}
        return generate(self.model, self.tokenizer, tokens, max_tokens=max_tokens, **quantized)


def chat_body(prompt: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def llama(tiny_model) -> Path:
    return tiny_model(arch="llama", layers=4, shards=2, rope_scaling="llama3")


@pytest.fixture(scope="module")
def oracle(llama: Path) -> Oracle:
    return Oracle(llama)


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
        yield Pair(p, d, p.get("/health", auth=False)["model"]["fingerprint"])


@dataclass
class BadPeer:
    """`tests.bad_prefill` in its own process, and a decode node that always prefills on it."""

    fake: NodeProc
    decode: NodeProc

    def set_mode(self, mode: str) -> None:
        assert mode in MODES
        reply = post(self.fake.url + "/control", {"mode": mode}, token=None, timeout=10)
        assert reply.status == 200, reply

    def prefills(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.fake.url + "/control", timeout=10) as r:
            return json.loads(r.read())["prefills"]

    def thaw(self) -> None:
        """Undo a freeze and wait until the decode node trusts the peer again."""
        self.fake.proc.send_signal(signal.SIGCONT)
        self.set_mode("good")
        wait_trusted(self.decode, timeout=30)


@contextlib.contextmanager
def bad_peer(model: Path, tmp: Path) -> Iterator[BadPeer]:
    port = free_port()
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    log = tmp / "bad-prefill.log"
    cmd = [sys.executable, "-m", "tests.bad_prefill", "--model", str(model)]
    cmd += ["--token-file", str(token_file), "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    fake = NodeProc(proc, port, log)
    try:
        wait_healthy(fake)
        decode = start_node(
            tmp, model, "decode", "--peer", fake.url, "--remote-prefill", "always", token=TOKEN
        )
        try:
            wait_trusted(decode)
            yield BadPeer(fake, decode)
        finally:
            decode.stop()
    finally:
        proc.send_signal(signal.SIGCONT)  # a frozen process would not see SIGTERM
        fake.stop()


@pytest.fixture(scope="module")
def bad(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BadPeer]:
    with bad_peer(llama, tmp_path_factory.mktemp("bad")) as peer:
        yield peer


# --- 1, 2: bodies the JSON parser or the tokenizer chokes on ------------------------------


def _routes(pair: Pair) -> dict[str, str]:
    return {
        "chat": pair.decode.url + "/v1/chat/completions",
        "completions": pair.decode.url + "/v1/completions",
        "prefill": pair.prefill.url + "/v1/prefill",
        "hello-decode": pair.decode.url + "/v1/hello",
        "hello-prefill": pair.prefill.url + "/v1/hello",
    }


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
    problems = [
        f"body {i}: {p}"
        for i, body in enumerate(DEEP_BODIES[route])
        if (p := error_problem(post(url, body))) is not None
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
        if r["kind"] == "request" and not r["request_id"].startswith("probe-")
    ]  # fmt: skip
    assert not prefill_side, f"the prefill node ran: {prefill_side}"
    started = [
        r for r in events_since(pair.decode, t0)
        if r["kind"] == "request" and r["phase"] == "prefill_start"
        and not r["request_id"].startswith("probe-")
    ]  # fmt: skip
    assert not started, started


@pytest.mark.parametrize(
    "field", [{"max_tokens": 0}, {"max_tokens": False}, {"max_completion_tokens": 0}]
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_max_tokens_zero_or_false_is_400(pair: Pair, route: str, field: dict[str, Any]) -> None:
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Count to ten."}]}
        if route == "chat"
        else {"prompt": "Count to ten."}
    )
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
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Say hi."}]}
        if route == "chat"
        else {"prompt": "Say hi."}
    )
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
    records = [r for r in events_since(bad.decode, t0) if r["request_id"] == body["id"]]
    phases = [r["phase"] for r in records if r["kind"] == "request"]
    assert "failed" in phases, phases
    assert body["tandem"]["prefill"] == "local", body["tandem"]


def test_a_quantized_prefill_cut_off_falls_back_to_mlx_lms_own(tiny_model, tmp_path: Path) -> None:
    """Two quantized layers land, then the prefill node hangs up: the local prefill that
    follows runs on the caches as they were before the request (float, quantized after the
    prompt as mlx-lm does), not on the two layers the failed stream had made quantized."""
    model = tiny_model(arch="llama", layers=4, hidden=64, heads=2, kv_heads=1, head_dim=64)
    oracle = Oracle(model)
    prompt = "The keeper counted the waves, the gulls and the ships that never came back."
    with bad_peer(model, tmp_path) as bad:
        got, served = _cut_off(bad, prompt)
    assert got["id"] in served and got["tandem"]["prefill"] == "local", got["tandem"]
    assert got["tandem"]["kv_dtype"] == "q4/g32"
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
    assert body["tandem"]["prefill"] == "local"


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
    assert body["tandem"]["prefill"] == "local"


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
