"""Issue 33, 3: tools round trip through a real decode node and the real openai client, on a
made model whose chat template takes tools and whose weights emit one call
(tests/tools_model.py); the calls equal what mlx-lm's own server makes of the same text. A
model without tool calling refuses tools and the tool role (400)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from mlx_lm import generate, load
from mlx_lm.server import ToolCallFormatter
from tandem.nodes.decode.openai_tools import split_tool_calls

from tests.conftest import MakeTiny
from tests.nodeproc import start_node
from tests.openai_support import all_healthy, openai_client
from tests.tools_model import CALL, make_tools_model

TOKEN = "tools-token-0123456789abcdef"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def nodes(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(the tools model, a node serving it, a node serving the plain tiny model)."""
    tmp = tmp_path_factory.mktemp("tools")
    model = make_tools_model(tmp / "tools-model")
    args = ("--remote-prefill", "never")
    tools = start_node(tmp, model, "decode", *args, token=TOKEN, wait=False)
    plain = start_node(tmp, tiny_model(), "decode", *args, token=TOKEN, wait=False)
    with all_healthy(tools, plain):
        yield model, tools, plain


def _mlx_calls(model: Path) -> list[dict[str, Any]]:
    """What mlx-lm's server makes of the same request: its own greedy text, the span between
    the markers given to its ToolCallFormatter."""
    m, tokenizer = load(str(model))
    prompt = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True)
    text = generate(m, tokenizer, prompt, max_tokens=16)
    assert text == f"<tool_call>{CALL}</tool_call>"
    span = text.removeprefix(tokenizer.tool_call_start).removesuffix(tokenizer.tool_call_end)
    return ToolCallFormatter(tokenizer.tool_parser, TOOLS)([span])


def test_a_tool_call_round_trips(nodes: Any) -> None:
    model, node, _ = nodes
    client = openai_client(node)
    r = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=16
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].type == "function" and calls[0].id
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    ours = [c.model_dump(exclude={"id"}) for c in calls]
    assert ours == [{k: v for k, v in c.items() if k != "id"} for c in _mlx_calls(model)]

    back = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    ]
    again = client.chat.completions.create(
        model="m", messages=back, tools=TOOLS, temperature=0, max_tokens=16
    )
    assert again.choices[0].finish_reason in ("tool_calls", "stop", "length")


def test_tool_choice_none_passes_no_tools(nodes: Any) -> None:
    _, node, _ = nodes
    r = openai_client(node).chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=16
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"stream": True},
    ],
)
def test_what_tools_does_not_do_is_refused(nodes: Any, extra: dict[str, Any]) -> None:
    _, node, _ = nodes
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(node).chat.completions.create(model="m", messages=ASK, tools=TOOLS, **extra)
    assert e.value.code == "unsupported_field"


def test_a_malformed_tool_is_400(nodes: Any) -> None:
    _, node, _ = nodes
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(node).chat.completions.create(
            model="m", messages=ASK, tools=[{"type": "function", "function": {"x": 1}}]
        )
    assert e.value.code != "unsupported_field"


def test_a_model_without_tool_calling_refuses_tools_and_the_tool_role(nodes: Any) -> None:
    _, _, plain = nodes
    client = openai_client(plain)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    assert e.value.code == "unsupported_field"
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[*ASK, tool])
    assert "role" in str(e.value)


@pytest.mark.parametrize(
    "text",
    [
        f"<tool_call>{CALL}</tool_call>",
        f"Let me look.<tool_call>{CALL}</tool_call> and <tool_call>{CALL}</tool_call>done",
        f"<tool_call>{CALL}",  # stopped inside the call: parsed all the same
        "<tool_call>{not json</tool_call>after",  # dropped, as mlx-lm drops it
        "no call at all",
    ],
)
def test_the_split_is_mlx_lms(text: str) -> None:
    """Our split of a generated text into content and calls, against mlx-lm's server's
    (its json_tools parser; the spans between the markers given to ToolCallFormatter)."""
    from mlx_lm.tool_parsers import json_tools

    start, end = json_tools.tool_call_start, json_tools.tool_call_end
    content, calls = split_tool_calls(text, start, end, json_tools.parse_tool_call, TOOLS)
    pieces = text.split(start)
    spans = [p.partition(end)[0] for p in pieces[1:]]
    outside = pieces[0] + "".join(p.partition(end)[2] for p in pieces[1:])
    theirs = ToolCallFormatter(json_tools.parse_tool_call, TOOLS)(spans)
    assert content == outside
    assert [{**c, "id": ""} for c in calls] == [{**c, "id": ""} for c in theirs]


@pytest.mark.parametrize("span", ["1", '"f"', "[1, 2]", '{"arguments": {}}', '{"name": 5}'])
def test_a_call_that_is_not_an_object_with_a_name_stays_text(span: str) -> None:
    """Issue 47 item 6: what a model writes between the markers that parses to no call (a
    number, a string, a nameless object) is no call, and no 500: its text stays."""
    from mlx_lm.tool_parsers import json_tools

    start, end = json_tools.tool_call_start, json_tools.tool_call_end
    text = f"before{start}{span}{end}after"
    content, calls = split_tool_calls(text, start, end, json_tools.parse_tool_call, TOOLS)
    assert calls == [] and content == text
