"""OpenAI request parsing and response shapes (pure: no I/O, no mlx).

A body either parses into a `Completion` or raises `ApiError` with the 4xx the client gets:
every field that is present must have the type and range the OpenAI API gives it, and what
tandem does not do is refused (400 `unsupported_field`, naming it), never ignored. README
"OpenAI fields" lists each field and what tandem does with it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.nodes.contract.http import (
    DEFAULT_KV_GROUP_SIZE,
    ApiError,
    KVFormat,
    KVKernel,
    check_group_size,
    kv_format_of,
)
from tandem.nodes.decode.openai_tools import TOOL_FIELDS, assistant_calls, tool_message

MAX_STOP = 4
DEFAULT_MAX_TOKENS = 256
SEED_RANGE = (0, 2**63 - 1)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's)
BIAS_RANGE = (-100.0, 100.0)  # a logit_bias value (OpenAI's)
MAX_BIAS = 300  # logit_bias entries
MAX_TOP_LOGPROBS = 20  # chat; a completion's `logprobs` takes at most 5
# a completion's fields that ask for more than one plain continuation: their harmless values
NOT_ECHOED: dict[str, tuple[object, ...]] = {"echo": (None, False), "suffix": (None, ""),
                                             "best_of": (None, 1)}  # fmt: skip
ROLES = frozenset({"system", "user", "assistant"})
TOOL_ROLES = ROLES | {"tool"}  # where the model's chat template takes tools
# OpenAI fields this node does not do: refused when present with a value that asks for them
UNSUPPORTED = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
    "modalities", "prediction", "reasoning_effort", "web_search_options", "service_tier",
)  # fmt: skip
# every field the README's table names; anything else is refused by name, never ignored
COMMON_FIELDS = frozenset({
    "model", "user", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
    "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "stream", "stream_options", "n", "response_format", "tandem", *UNSUPPORTED,
})  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {"messages"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", *NOT_ECHOED}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0  # mlx-lm's logits processors, over the last 20 tokens
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: bool = False  # each token's log-probability in the reply
    top_logprobs: int = 0  # with the `n` likeliest alternatives at each position


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the likeliest alternatives at its place."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Completion:
    """One parsed request: the prompt's token ids (after the chat template) and how to reply."""

    request_id: str
    tokens: list[int]
    sampling: Sampling
    stream: bool
    chat: bool
    kv_format: KVFormat | None = None  # how the KV crosses the wire (None: full precision)
    tools: list[dict[str, Any]] | None = None  # given to the chat template; calls parsed back


def messages_of(body: Mapping[str, Any], tools: bool = False) -> list[dict[str, Any]]:
    """A chat body's messages, role/content pairs of strings (a list of text parts joined).
    Roles: system, user, assistant; where the model takes `tools`, also tool messages and
    assistant `tool_calls`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    roles = TOOL_ROLES if tools else ROLES
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message needs a role and a content")
        if m["role"] not in roles:
            raise ApiError(400, f"message role must be one of {', '.join(sorted(roles))}")
        if tools and m["role"] == "assistant" and m.get("tool_calls") not in (None, []):
            content = _content(m["content"]) if m.get("content") is not None else ""
            out.append({"role": "assistant", "content": content, "tool_calls": assistant_calls(m)})
        elif m["role"] == "tool":
            out.append(tool_message(m, _content(m.get("content"))))
        else:
            out.append({"role": m["role"], "content": _content(m.get("content"))})
    return out


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(400, "message content must be a string or a list of text parts")


def check_fields(body: Mapping[str, Any], chat: bool, tools: bool = False) -> None:
    """Refuse the fields this node does not do (any outside the README's table, by name),
    and those of the wrong type it ignores otherwise (`model`, `user`, `stream_options`,
    `response_format`). `tools`: the model's chat template takes tools, so a chat's tool
    fields are left to `openai_tools.tools_of`."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    if unknown := sorted(str(name) for name in body if name not in known):
        raise ApiError(400, f"{unknown[0]} is not supported by this node", "unsupported_field")
    for name in UNSUPPORTED:
        if tools and chat and name in TOOL_FIELDS:
            continue
        value = body.get(name)  # absent, null, false, empty or "none" asks for nothing
        if not (value is None or value is False or value == [] or value == "none"):
            raise ApiError(400, f"{name} is not supported by this node", "unsupported_field")
    if "model" in body and not isinstance(body["model"], str):
        raise ApiError(400, "model must be a string")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "user must be a string")
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)
    ):
        raise ApiError(400, "stream_options must be an object with a boolean include_usage")
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ApiError(400, "response_format must be an object with a type")
        if fmt["type"] != "text":
            raise ApiError(400, f"response_format {fmt['type']} is not supported by this node",
                           "unsupported_field")  # fmt: skip
    if not chat:
        for name, allowed in NOT_ECHOED.items():
            if body.get(name) not in allowed:
                raise ApiError(400, f"{name} is not supported by this node", "unsupported_field")


def prompt_of(body: Mapping[str, Any], vocab_size: int) -> str | list[int]:
    """A completion body's prompt: text, or token ids in the vocabulary."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, "prompt token id outside the vocabulary")
        return list(prompt)
    if isinstance(prompt, str) and prompt:
        return prompt
    raise ApiError(400, "prompt must be a non-empty string or list of token ids")


def sampling_of(
    body: Mapping[str, Any], max_tokens_limit: int, vocab_size: int | None = None,
    chat: bool = True,
) -> Sampling:  # fmt: skip
    """The reply's sampling parameters; checked before any prefill runs."""
    if "n" in body and (type(body["n"]) is not int or body["n"] != 1):
        raise ApiError(400, "n must be 1: one choice per request")
    if "stream" in body and body["stream"] is not None and type(body["stream"]) is not bool:
        raise ApiError(400, "stream must be true or false")
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
    if type(max_tokens) is not int or not 1 <= max_tokens <= max_tokens_limit:
        raise ApiError(400, f"{key} must be an integer in 1..{max_tokens_limit}")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > MAX_STOP:
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOP}")
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop strings must be strings")
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ApiError(400, f"seed must be an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}")
    if logprobs_asked(body) and body.get("stream") is True:
        raise ApiError(400, "logprobs with stream is not supported by this node",
                       "unsupported_field")  # fmt: skip
    presence = _number(body, "presence_penalty", 0.0, *PENALTY_RANGE)
    frequency = _number(body, "frequency_penalty", 0.0, *PENALTY_RANGE)
    logprobs, top = _logprobs(body, chat)
    return Sampling(
        max_tokens, temperature, top_p, tuple(stop), seed, presence, frequency,
        _logit_bias(body, vocab_size), logprobs, top,
    )  # fmt: skip


def logprobs_asked(body: Mapping[str, Any]) -> bool:
    return body.get("logprobs") not in (None, False)


def _logprobs(body: Mapping[str, Any], chat: bool) -> tuple[bool, int]:
    """(logprobs asked for, alternatives per position): chat's boolean `logprobs` with
    `top_logprobs` 0..20; a completion's `logprobs` is itself the count, 0..5."""
    value = body.get("logprobs")
    if not chat:
        if value is None:
            return False, 0
        if type(value) is not int or not 0 <= value <= 5:
            raise ApiError(400, "logprobs must be an integer in 0..5")
        return True, value
    if value is not None and type(value) is not bool:
        raise ApiError(400, "logprobs must be true or false")
    top = body.get("top_logprobs")
    if top is None:
        return bool(value), 0
    if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}")
    if value is not True:
        raise ApiError(400, "top_logprobs needs logprobs: true")
    return True, top


def _logit_bias(body: Mapping[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: token ids (as strings, below `vocab_size` where known) to values in
    [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_BIAS:
        raise ApiError(400, f"logit_bias must be an object of up to {MAX_BIAS} token ids")
    out = []
    for key, value in bias.items():
        # ASCII digits only: str.isdigit takes "²", "٥" and "５", and int() reads two of them
        ascii_id = isinstance(key, str) and key.isascii() and key.isdigit()
        if not ascii_id or int(key) >= (vocab_size or 2**31):
            raise ApiError(400, "logit_bias keys must be token ids in the vocabulary")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ApiError(400, "logit_bias values must be numbers")
        if not BIAS_RANGE[0] <= value <= BIAS_RANGE[1]:
            raise ApiError(400, f"logit_bias values must be in [{BIAS_RANGE[0]}, {BIAS_RANGE[1]}]")
        out.append((int(key), float(value)))
    return tuple(out)


def kv_format_in(
    body: Mapping[str, Any], default: KVFormat | None, kernel: KVKernel = "cpu",
    head_dim: int | None = None, group_size: int = DEFAULT_KV_GROUP_SIZE,
    float_only: bool = False,
) -> KVFormat | None:  # fmt: skip
    """The request's KV format: the `tandem` extension's `kv_bits` (16 or 0: full precision)
    and `kv_group_size`, each the node's default where it is absent or null (`kv_bits` 8
    alone takes the node's group size, `group_size`, even where the node's own default is
    full precision; a group size alone, the node's bits). A group size must divide the
    model's `head_dim` (groups run along each head's vector). `float_only`: a model with
    attention sinks or latent layers, which mlx-lm attends over a float cache only."""
    extension = body.get("tandem")
    if extension is None:
        return default
    if not isinstance(extension, dict):
        raise ApiError(400, "tandem must be an object")
    asked = {k: v for k in ("kv_bits", "kv_group_size") if (v := extension.get(k)) is not None}
    if not asked:
        return default
    if default is not None:
        asked.setdefault("kv_bits", default.bits)
    if asked.get("kv_bits") not in (None, 0, 16):
        asked.setdefault("kv_group_size", default.group_size if default else group_size)
    if float_only and asked.get("kv_bits") not in (None, 0, 16):
        raise ApiError(400, "tandem: kv_bits: this model's cache is float only (mlx-lm attends "
                       "with sinks, or over latents, in float)")  # fmt: skip
    try:
        fmt = kv_format_of({**asked, "kv_kernel": kernel})
        if fmt is not None and head_dim is not None:
            check_group_size(fmt.group_size, head_dim)
    except ValueError as e:
        raise ApiError(400, f"tandem: {e}") from None
    return fmt


def completion(
    body: Mapping[str, Any],
    tokens: list[int],
    sampling: Sampling,
    chat: bool,
    context: int,
    kv_format: KVFormat | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Completion:
    if not tokens:
        raise ApiError(400, "the prompt is empty after tokenization")
    if len(tokens) + sampling.max_tokens > context:
        raise ApiError(
            400,
            f"prompt ({len(tokens)} tokens) plus max_tokens ({sampling.max_tokens}) exceeds "
            f"the model's context of {context} tokens",
            "context_length_exceeded",
        )
    prefix = "chatcmpl-" if chat else "cmpl-"
    return Completion(
        request_id=prefix + uuid.uuid4().hex[:24],
        tokens=tokens,
        sampling=sampling,
        stream=body.get("stream") is True,
        chat=chat,
        kv_format=kv_format,
        tools=tools,
    )


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}]")
    return float(value)
