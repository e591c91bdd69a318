"""Issue 33, 3: every OpenAI field is honoured or refused (400 `unsupported_field` naming it),
and a field of the wrong type is a 400, never ignored. Parsing here; what the honoured fields
do to a generation is checked through a real node in tests/test_openai_generation.py."""

from __future__ import annotations

from typing import Any

import pytest
from tandem.nodes.contract.http import ApiError
from tandem.nodes.decode import openai_api as oa
from tandem.nodes.decode.openai_tools import tools_of

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
VOCAB = 1000


def _refused(body: dict[str, Any], chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as e:
        oa.check_fields(body, chat)
        if chat:
            oa.messages_of(body)
        oa.sampling_of(body, 4096, VOCAB, chat=chat)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("parallel_tool_calls", True),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("audio", {"voice": "x"}),
        ("modalities", ["audio"]),
        ("reasoning_effort", "high"),
    ],
)
def test_what_the_node_does_not_do_is_refused_by_name(field: str, value: Any) -> None:
    e = _refused({**CHAT, field: value})
    assert e.code == "unsupported_field"
    assert field in str(e)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", "x"),
        ("top_logprobs", -1),
        ("top_logprobs", 21),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {str(VOCAB): 1}),
        ("logit_bias", {"5": "1"}),
        ("logit_bias", [1]),
        ("presence_penalty", "x"),
        ("presence_penalty", 2.5),
        ("frequency_penalty", 1e9),
        ("frequency_penalty", True),
        ("model", 5),
        ("user", 5),
        ("stream_options", "x"),
        ("stream_options", {"include_usage": "yes"}),
        ("response_format", "json"),
        ("n", 2),
    ],
)
def test_a_wrong_type_or_range_is_400(field: str, value: Any) -> None:
    e = _refused({**CHAT, field: value})
    assert e.code != "unsupported_field" or field in ("n",)


def test_top_logprobs_needs_logprobs() -> None:
    assert "logprobs" in str(_refused({**CHAT, "top_logprobs": 2}))


@pytest.mark.parametrize("role", ["tool", "", "foo", "developer", "function"])
def test_roles_beyond_system_user_assistant_are_400(role: str) -> None:
    body = {"messages": [{"role": role, "content": "x"}]}
    assert "role" in str(_refused(body))


def test_content_parts_are_joined_and_other_parts_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert oa.messages_of({"messages": [{"role": "user", "content": parts}]}) == [
        {"role": "user", "content": "ab"}
    ]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    _refused({"messages": [{"role": "user", "content": image}]})


@pytest.mark.parametrize(
    ("field", "value"), [("echo", True), ("suffix", "x"), ("best_of", 2), ("logprobs", 6)]
)
def test_completion_fields_beyond_one_continuation_are_refused(field: str, value: Any) -> None:
    _refused({"prompt": "x", field: value}, chat=False)


def test_honoured_fields_parse() -> None:
    body = {
        **CHAT, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5,
        "frequency_penalty": -1, "logit_bias": {"7": -100, "9": 2.5}, "model": "m",
        "user": "u", "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
        "tools": [], "tool_choice": "none", "parallel_tool_calls": False,
    }  # fmt: skip
    oa.check_fields(body, True)
    s = oa.sampling_of(body, 4096, VOCAB)
    assert (s.logprobs, s.top_logprobs) == (True, 3)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.0)
    assert s.logit_bias == ((7, -100.0), (9, 2.5))
    legacy = oa.sampling_of({"prompt": "x", "logprobs": 2}, 4096, VOCAB, chat=False)
    assert (legacy.logprobs, legacy.top_logprobs) == (True, 2)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _refused_with_tools(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        oa.check_fields(body, True, tools=True)
        oa.messages_of(body, tools=True)
        tools_of(body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "invalid_request_error"),
        ({"tools": [{"type": "x", "function": {"name": "f"}}]}, "invalid_request_error"),
        ({"tools": {"f": 1}}, "invalid_request_error"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "invalid_request_error"),
        ({"tools": [TOOL], "tool_choice": "required"}, "unsupported_field"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "unsupported_field"),
        ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "invalid_request_error"),
        ({"tools": [TOOL], "stream": True}, "unsupported_field"),
        ({"functions": [{"name": "f"}]}, "unsupported_field"),
    ],
)  # fmt: skip
def test_tools_where_the_model_takes_them(extra: dict[str, Any], code: str) -> None:
    assert _refused_with_tools({**CHAT, **extra}).code == code


def test_tool_messages_parse_where_the_model_takes_tools() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    body = {
        "messages": [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": True,
    }  # fmt: skip
    oa.check_fields(body, True, tools=True)
    assert tools_of(body) == [TOOL]
    assert tools_of({**body, "tool_choice": "none"}) is None
    assert oa.messages_of(body, tools=True) == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
        ]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
    ]  # fmt: skip
    for bad in ({"role": "tool", "content": "ok"}, {"role": "assistant", "tool_calls": [{}]}):
        _refused_with_tools({"messages": [bad]})


@pytest.mark.parametrize(
    "field", ["top_k", "min_p", "repetition_penalty", "store", "metadata", "foo"]
)
@pytest.mark.parametrize("chat", [True, False])
def test_a_field_outside_the_readmes_table_is_refused_by_name(field: str, chat: bool) -> None:
    """Issue 47 item 7: nothing is silently ignored."""
    body = {**(CHAT if chat else {"prompt": "hi"}), field: 1}
    e = _refused(body, chat)
    assert e.code == "unsupported_field" and field in str(e)


def test_tools_zero_is_not_taken_for_none() -> None:
    e = _refused({**CHAT, "tools": 0})
    assert e.code == "unsupported_field" and "tools" in str(e)


@pytest.mark.parametrize("key", ["²", "٥", "５", "1²"])
def test_logit_bias_keys_are_ascii_digits(key: str) -> None:
    """Issue 47 item 6: `str.isdigit` takes these, and `int` reads "٥" and "５" as 5."""
    e = _refused({**CHAT, "logit_bias": {key: 1}})
    assert e.code != "unsupported_field" and "logit_bias" in str(e)
