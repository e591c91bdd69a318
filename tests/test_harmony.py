"""Issue 49, 6: gpt-oss's Harmony replies. The parser (nodes/decode/harmony.py) on text as
gpt-oss writes it: channels, tool calls in each header form, the stream against the whole,
a cut reply, plain text. The made gpt-oss tokenizer (factory_harmony.py): its special tokens
and chat template. Then through a real decode node and the real openai client, on made models
whose greedy replies are Harmony (tests/harmony_model.py): reasoning and content split, whole
and streamed; a tool call; a plain completion's raw text."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tandem.nodes.decode.harmony import (
    MARKERS,
    Delta,
    HarmonyReply,
    HarmonyStream,
    ToolCall,
    parse,
    speaks_harmony,
)
from tandem.nodes.model.factory_harmony import HARMONY_SPECIAL_TOKENS, write_harmony_tokenizer

from tests.harmony_model import ANSWER, CALL, make_harmony_model
from tests.nodeproc import start_node
from tests.openai_support import all_healthy, openai_client
from tests.test_tools import ASK, TOOLS  # the same request of the same tool

TOKEN = "harmony-token-0123456789abcdef"
ARGS = '{"city": "Paris"}'
WEATHER = ToolCall("get_weather", ARGS)
PLAIN = "Just plain text, to=nobody <| not a marker"
THOUGHT = "<|channel|>analysis<|message|>The user asks for the weather. Need a tool.<|end|>"
REPLIES: dict[str, tuple[str, HarmonyReply]] = {
    "analysis+final": (
        "<|channel|>analysis<|message|>User says hi. Reply politely.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>",
        HarmonyReply("Hello! How can I help?", "User says hi. Reply politely.", ()),
    ),
    "final only, eos cut": (
        "<|channel|>final<|message|>Hi there.",
        HarmonyReply("Hi there.", "", ()),
    ),
    "call, recipient after channel, constrain": (
        THOUGHT + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        f"<|constrain|>json<|message|>{ARGS}<|call|>",
        HarmonyReply("", "The user asks for the weather. Need a tool.", (WEATHER,)),
    ),
    "call, recipient before channel, bare json": (
        THOUGHT + "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        f"<|message|>{ARGS}<|call|>",
        HarmonyReply("", "The user asks for the weather. Need a tool.", (WEATHER,)),
    ),
    "call, no constrain, first message, eos cut": (
        f" to=functions.get_weather<|channel|>commentary<|message|>{ARGS}",
        HarmonyReply("", "", (WEATHER,)),
    ),
    "preamble, two calls": (
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{ARGS}"
        "<|call|><|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{}",
        HarmonyReply("Checking both.", "", (WEATHER, ToolCall("get_time", "{}"))),
    ),
    "cut mid-analysis": (
        "<|channel|>analysis<|message|>Let me think about wh",
        HarmonyReply("", "Let me think about wh", ()),
    ),
    "cut mid-call": (
        '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa',
        HarmonyReply("", "", ()),
    ),
    "cut mid-header": (
        THOUGHT + "<|start|>assistant<|channel|>fin",
        HarmonyReply("", "The user asks for the weather. Need a tool.", ()),
    ),
    "no markers": (PLAIN, HarmonyReply(PLAIN, "", ())),
    "the model writes a tool's answer": (
        f"<|channel|>commentary to=functions.get_weather<|message|>{ARGS}<|call|>"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.",
        HarmonyReply("It is sunny.", "", (WEATHER,)),
    ),
    "a built-in tool, arguments no JSON": (
        "<|channel|>analysis to=browser.search<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>Paris<|call|>",
        HarmonyReply("", "", ()),
    ),
    "a code sample with markers' look-alikes": (
        "<|channel|>final<|message|>x = a <| b |> c; y = '<|'",
        HarmonyReply("x = a <| b |> c; y = '<|'", "", ()),
    ),
}


def _stream(pieces: list[str]) -> list[Delta | ToolCall]:
    stream = HarmonyStream()
    events = [e for p in pieces for e in stream.feed(p)]
    return events + stream.finish()


@pytest.mark.parametrize("name", list(REPLIES))
def test_the_whole_parse(name: str) -> None:
    text, want = REPLIES[name]
    assert parse(text) == want


@pytest.mark.parametrize("name", list(REPLIES))
def test_the_stream_gives_the_whole_parse(name: str) -> None:
    """Split anywhere, the stream's events add up to the whole parse; one character at a time,
    no delta holds a marker or a piece of one."""
    text, _ = REPLIES[name]
    whole = parse(text)
    for at in range(len(text) + 1):
        assert HarmonyReply.of(_stream([text[:at], text[at:]])) == whole, at
    by_char = _stream(list(text))
    assert HarmonyReply.of(by_char) == whole
    if name != "no markers" and "look-alikes" not in name:
        deltas = [e.text for e in by_char if isinstance(e, Delta)]
        assert not any(part in d for d in deltas for part in ("<|", "|>"))


def test_deltas_arrive_as_the_text_does() -> None:
    stream = HarmonyStream()
    assert stream.feed("<|channel|>analysis<|mess") == []
    assert stream.feed("age|>Think") == [Delta("reasoning", "Think")]
    assert stream.feed("ing.<|end|><|start|>assistant<|channel|>final<|message|>Hi") == [
        Delta("reasoning", "ing."),
        Delta("content", "Hi"),
    ]
    assert stream.feed("<|") == []  # may be a marker: held
    assert stream.finish() == [Delta("content", "<|")]


def test_a_call_has_openais_shape() -> None:
    call = parse(REPLIES["call, recipient before channel, bare json"][0]).tool_calls[0].openai()
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert call["id"] != WEATHER.openai()["id"]


def test_the_parser_imports_the_stdlib_only() -> None:
    code = "import sys, tandem.nodes.decode.harmony; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {name.split(".")[0] for name in out.stdout.split()}
    assert loaded & {"mlx", "mlx_lm", "transformers", "tokenizers", "numpy", "aiohttp"} == set()
    assert "tandem" in loaded


def test_speaks_harmony() -> None:
    assert speaks_harmony(dict.fromkeys(HARMONY_SPECIAL_TOKENS, 0))
    assert not speaks_harmony({"<|im_start|>": 1, "<|im_end|>": 2, "<|channel>": 3})


# ------------------------------------------------------------------ the made tokenizer


def test_the_harmony_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert write_harmony_tokenizer(tmp_path, 400, 1024) == (1, 0, 2)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|return|>" and tok.model_max_length == 1024
    assert tok.convert_tokens_to_ids(list(HARMONY_SPECIAL_TOKENS)) == list(range(8))
    text = "".join(MARKERS) + "Hello"
    assert tok.decode(tok.encode(text)) == text  # each marker one token, written back as text

    chat = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]  # fmt: skip
    got = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert got == (
        "<|start|>system<|message|>Be brief.<|end|>"
        "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// The weather in a city\ntype get_weather = (_: "
        + json.dumps(TOOLS[0]["function"]["parameters"])
        + ") => any;\n\n} // namespace functions<|end|>"
        "<|start|>user<|message|>What is the weather in Paris?<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.<|end|>"
        "<|start|>assistant"
    )
    plain = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert plain == "<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant"


# ------------------------------------------------------------------ through a decode node


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(a node whose model answers after its analysis, one whose model calls get_weather)."""
    tmp = tmp_path_factory.mktemp("harmony")
    args = ("--remote-prefill", "never")
    answer = make_harmony_model(tmp / "answer", ANSWER)
    call = make_harmony_model(tmp / "call", CALL)
    answers = start_node(tmp, answer, "decode", *args, token=TOKEN, wait=False)
    calls = start_node(tmp, call, "decode", *args, token=TOKEN, wait=False)
    with all_healthy(answers, calls):
        yield answers, calls


def test_a_reply_splits_into_reasoning_and_content(nodes: Any) -> None:
    answers, _ = nodes
    r = openai_client(answers).chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=16
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "Hello!"
    assert (choice.message.model_extra or {}).get("reasoning") == "Thinking."
    assert choice.message.tool_calls is None


def test_a_stream_splits_as_the_whole(nodes: Any) -> None:
    answers, _ = nodes
    chunks = list(
        openai_client(answers).chat.completions.create(
            model="m", messages=ASK, temperature=0, max_tokens=16, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    fields = [
        (field, text)
        for d in deltas
        for field, text in (("content", d.content), *(d.model_extra or {}).items())
        if text
    ]
    assert "".join(t for f, t in fields if f == "reasoning") == "Thinking."
    assert "".join(t for f, t in fields if f == "content") == "Hello!"
    kinds = [f for f, _ in fields]
    assert kinds == ["reasoning"] * kinds.count("reasoning") + ["content"] * kinds.count("content")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_reply_cut_in_its_analysis(nodes: Any) -> None:
    answers, _ = nodes
    r = openai_client(answers).chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=4
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content
    assert (choice.message.model_extra or {}).get("reasoning") == "Thinking."


def test_a_tool_call_round_trips(nodes: Any) -> None:
    _, calls = nodes
    client = openai_client(calls)
    r = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=16
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert (choice.message.model_extra or {}).get("reasoning") == "Thinking."
    tool_calls = choice.message.tool_calls
    assert tool_calls is not None and len(tool_calls) == 1
    assert tool_calls[0].function.name == "get_weather" and tool_calls[0].id
    assert json.loads(tool_calls[0].function.arguments) == {"city": "Paris"}
    back = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in tool_calls]},
        {"role": "tool", "tool_call_id": tool_calls[0].id, "content": "sunny"},
    ]
    again = client.chat.completions.create(
        model="m", messages=back, tools=TOOLS, temperature=0, max_tokens=16
    )
    assert again.choices[0].finish_reason == "tool_calls"


def test_a_completion_is_raw_text(nodes: Any) -> None:
    answers, _ = nodes
    r = openai_client(answers).completions.create(
        model="m", prompt="<|start|>user<|message|>hi<|end|><|start|>assistant", max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert r.choices[0].text == "".join(ANSWER[:-1])  # the eos's text is not written
