"""OpenAI tool calling (pure: no I/O, no mlx): `tools`/`tool_choice` checked and passed to the
chat template, `tool` and tool-calling `assistant` messages shaped as mlx-lm's server gives
them to the template, and the generated text split into content and `tool_calls` as mlx-lm's
server splits it (`ToolCallFormatter`). Only where the model's tokenizer has tool calling
(mlx-lm infers it from the chat template); elsewhere `openai_api` refuses all of it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from tandem.nodes.contract.http import ApiError

log = logging.getLogger(__name__)
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
# what mlx-lm's tokenizer gives: (the text between the markers, the request's tools) -> a call
# ({"name", "arguments"}) or a list of them
ToolParser = Callable[[str, Any], Any]


def tools_of(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools to give the chat template: None where there are none or `tool_choice` is
    "none". "required" or a named function is refused: nothing here forces a call."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(map(_is_tool, tools))):
        raise ApiError(400, "tools must be a list of {type: function, function: {name, ...}}")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        named = isinstance(choice, dict) and choice.get("type") == "function"
        if choice != "required" and not (named and _named(choice.get("function"))):
            raise ApiError(400, "tool_choice must be none, auto, required or a named function")
        raise ApiError(400, f"tool_choice {json.dumps(choice)} is not supported by this node",
                       "unsupported_field")  # fmt: skip
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise ApiError(400, "parallel_tool_calls must be true or false")
    if not tools or choice == "none":
        return None
    if body.get("stream") is True:
        raise ApiError(400, "tools with stream is not supported by this node", "unsupported_field")
    return list(tools)


def _named(function: Any) -> bool:
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _is_tool(tool: Any) -> bool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return False
    f = tool.get("function")
    return (
        _named(f)
        and isinstance(f.get("description", ""), str)
        and isinstance(f.get("parameters", {}), dict)
    )


def tool_message(m: Mapping[str, Any], content: str) -> dict[str, Any]:
    """A `tool` message for the template: its content and the call it answers."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str):
        raise ApiError(400, "a tool message needs a string tool_call_id")
    return {"role": "tool", "content": content, "tool_call_id": call_id}


def assistant_calls(m: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, their JSON arguments decoded into objects (as
    mlx-lm's server gives them to the template)."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ApiError(400, "tool_calls must be a non-empty list")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not (_named(f) and c.get("type", "function") == "function"):
            raise ApiError(400, "each tool call needs {type: function, function: {name, ...}}")
        args = f.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ApiError(400, "tool call arguments must be a JSON string") from None
        call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        out.append({**call, "id": c["id"]} if isinstance(c.get("id"), str) else call)
    return out


def split_tool_calls(
    text: str, start: str, end: str, parse: ToolParser, tools: Any
) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the calls, the calls): each span between `start` and `end` (or from
    `start` to the end, where generation stopped inside a call) parsed by `parse`, as
    mlx-lm's server does. A span that does not parse is dropped with a warning, as there; one
    that parses to something other than objects with a string `name` (a model writes what it
    writes: `<tool_call>1</tool_call>`) is no call either, and its text stays in the
    content."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    rest = text
    while (at := rest.find(start)) >= 0:
        content.append(rest[:at])
        span, closed, rest = rest[at + len(start) :].partition(end)
        try:
            parsed = parse(span, tools)
        except ValueError as e:  # json.JSONDecodeError is one
            log.warning("tool call does not parse (%s: %s); dropped", type(e).__name__, e)
            continue
        except (TypeError, KeyError, AttributeError) as e:  # a parser fed what it did not expect
            log.warning("tool call %r is not a call (%s); kept as text", span[:80], e)
            content.append(start + span + closed)
            continue
        found = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(c, Mapping) and isinstance(c.get("name"), str) for c in found):
            log.warning("tool call %r is not an object with a string name; kept as text",
                        span[:80])  # fmt: skip
            content.append(start + span + closed)
            continue
        calls.extend(_call_json(c) for c in found)
    content.append(rest)
    return "".join(content), calls


def _call_json(call: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's shape of one parsed call: its arguments as a JSON string."""
    function = {k: v for k, v in call.items() if k != "id"}
    function["arguments"] = json.dumps(call.get("arguments", {}), ensure_ascii=False)
    call_id = call.get("id") or "call_" + uuid.uuid4().hex[:24]
    return {"id": call_id, "type": "function", "function": function}
