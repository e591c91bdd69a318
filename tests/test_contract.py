"""The contract module (nodes/contract/http.py): stdlib only, and what every side relies on — the
body reader, SSE, the /health record, event records — plus the pure OpenAI parsing."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tandem.nodes.contract.cluster import Batching, Health, PrefillQueue
from tandem.nodes.contract.events import (
    LayerEvent,
    LinkEvent,
    RequestEvent,
    TokenEvent,
    event_from_json,
)
from tandem.nodes.contract.http import (
    MAX_JSON_DEPTH,
    SSE_END,
    BadBody,
    KVFormat,
    error_body,
    read_json,
    sse_encode,
    sse_record,
)
from tandem.nodes.decode import openai_api as oa

from tests.sse_support import sse_decode

ROOT = Path(__file__).resolve().parents[1]


def test_contract_imports_only_the_stdlib() -> None:
    code = (
        "import sys; before = set(sys.modules); import tandem.nodes.contract.http; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'tandem'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"[" * 100_000 + b"]" * 100_000, "deeper"),
        (b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1), "deeper"),
        (b'{"content": "\\ud800"}', "surrogate"),
        (b'{"\\udfff": 1}', "surrogate"),
        (b"\xff\xfe", "UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"NaN-ish", "not valid JSON"),
    ],
)
def test_bad_bodies_are_refused_with_a_reason(raw: bytes, why: str) -> None:
    with pytest.raises(BadBody, match=why):
        read_json(raw)


def test_good_bodies_read_as_json() -> None:
    assert read_json(b'{"a": ["[{", {"b": "\\u00e9\\ud83d\\ude00"}]}') == {
        "a": ["[{", {"b": "é😀"}]
    }
    deep = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert read_json(deep) is not None
    assert read_json(b'"a \\" [[[[ string"') == 'a " [[[[ string'  # brackets inside strings


def test_sse_round_trip() -> None:
    records = [{"a": 1}, {"b": [1, 2]}]
    stream = b"".join(sse_encode(r) for r in records) + b": keep-alive\n\n" + b"data: [DONE]\n\n"
    assert list(sse_decode(stream.splitlines())) == records
    assert sse_record(b"data: [DONE]") is SSE_END
    assert sse_record(b": comment") is None and sse_record("data: {broken") is None


def test_error_body_shape() -> None:
    body = error_body("no", "bad_request")
    assert body == {"error": {"message": "no", "type": "bad_request", "param": None,
                              "code": "bad_request"}}  # fmt: skip


def test_health_round_trip_and_bad_health() -> None:
    h = Health("id1", "n", ("prefill",), 1, "0.1", "cpu", 10, 5, "m", "f" * 64, 4)
    assert Health.from_json(json.loads(json.dumps(h.to_json()))) == h
    batching = Batching("continuous", 3, 1, 8, 3, "quantized KV steps beside the batch")
    decode = dataclasses.replace(h, roles=("decode",), batching=batching)
    assert Health.from_json(json.loads(json.dumps(decode.to_json()))) == decode
    with pytest.raises(ValueError, match="batching"):
        Health.from_json({**decode.to_json(), "batching": {"mode": "continuous", "running": "3"}})
    prefill = dataclasses.replace(h, queue=PrefillQueue(2, 300, 100, 1))
    assert Health.from_json(json.loads(json.dumps(prefill.to_json()))) == prefill
    assert prefill.queue is not None and prefill.queue.tokens == 400
    with pytest.raises(ValueError, match="queue"):
        Health.from_json({**prefill.to_json(), "queue": {"waiting": "2"}})
    for bad in ([], {"model": []}, {"roles": "prefill"}, {"proto": "x"}, {"mem_bytes": [1]}):
        with pytest.raises(ValueError):
            Health.from_json(bad)


def test_events_from_json() -> None:
    for event in (
        LayerEvent("r", t=1.0, layer=3, state="ready", slot=1, bytes=9),
        LinkEvent("r", name="net_in", bytes=4, seconds=0.5),
        RequestEvent("r", phase="failed", detail="x"),
        TokenEvent("r", count=7),
    ):
        assert event_from_json(json.loads(json.dumps(event.to_dict()))) == event
    assert event_from_json({"kind": "future", "request_id": "r"}) is None
    assert event_from_json({"kind": "layer"}) is None
    assert event_from_json({"kind": "token", "request_id": "r", "extra": 1}) == TokenEvent("r")


# ---------------------------------------------------------------- OpenAI parsing (pure)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": False}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": True}, "seed"),
        ({"stream": "false"}, "stream"),
        ({"n": 2}, "n must be 1"),
        ({"n": True}, "n must be 1"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"stop": ["a"] * 5}, "stop"),
    ],
)
def test_sampling_refuses_what_it_cannot_honour(body: dict, field: str) -> None:
    with pytest.raises(oa.ApiError, match=field) as e:
        oa.sampling_of(body, 4096)
    assert e.value.status == 400


def test_sampling_defaults_and_accepts() -> None:
    assert oa.sampling_of({}, 4096) == oa.Sampling(256)
    assert oa.sampling_of({}, 100).max_tokens == 100  # the default fits the limit
    s = oa.sampling_of({"max_tokens": 5, "seed": 0, "n": 1, "stream": False, "stop": "x"}, 4096)
    assert (s.max_tokens, s.seed, s.stop) == (5, 0, ("x",))
    req = oa.completion({"stream": True}, [1, 2], s, chat=True, context=64)
    assert req.stream and req.request_id.startswith("chatcmpl-")
    with pytest.raises(oa.ApiError, match="context"):
        oa.completion({}, list(range(62)), s, chat=False, context=64)


def test_a_requests_kv_format_falls_back_field_by_field() -> None:
    q8, q4g32 = KVFormat(8), KVFormat(4, 32)
    fmt = lambda ext, default: oa.kv_format_in({"tandem": ext}, default)  # noqa: E731
    assert fmt({}, q8) == q8 and oa.kv_format_in({}, q8) == q8
    assert fmt({"kv_bits": None, "kv_group_size": None}, q8) == q8  # null is unset, not 16
    assert fmt({"kv_bits": 16}, q8) is None and fmt({"kv_bits": 0}, q4g32) is None
    assert fmt({"kv_bits": 8}, q4g32) == KVFormat(8, 32)  # the node's group size
    assert fmt({"kv_group_size": 128}, q4g32) == KVFormat(4, 128)  # the node's bits
    assert fmt({"kv_bits": 4}, None) == KVFormat(4, 64)
    # a node whose own default is full precision still has its --kv-group-size
    assert oa.kv_format_in({"tandem": {"kv_bits": 8}}, None, group_size=32) == KVFormat(8, 32)
    for bad, default in (
        ({"kv_group_size": 32}, None),
        ({"kv_bits": 3}, q8),
        ({"kv_bits": 16, "kv_group_size": 32}, q8),
        ({"kv_bits": "8"}, None),
    ):
        with pytest.raises(oa.ApiError):
            fmt(bad, default)
