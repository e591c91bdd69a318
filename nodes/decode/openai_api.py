"""OpenAI request parsing and response shapes (pure: no I/O, no mlx).

A body either parses into a `Completion` or raises `ApiError` with the 4xx the client gets:
every field that is present must have the type and range the OpenAI API gives it, and what
tandem does not do (`n` > 1, a `stream` that is not a boolean) is refused, never ignored.
"""

from __future__ import annotations

import time
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

MAX_STOP = 4
DEFAULT_MAX_TOKENS = 256
SEED_RANGE = (0, 2**63 - 1)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    """One parsed request: the prompt's token ids (after the chat template) and how to reply."""

    request_id: str
    tokens: list[int]
    sampling: Sampling
    stream: bool
    chat: bool
    kv_format: KVFormat | None = None  # how the KV crosses the wire (None: full precision)


def messages_of(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """A chat body's messages, as role/content pairs of strings."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message needs a role and a content")
        if not isinstance(m.get("content"), str):
            raise ApiError(400, "message content must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


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


def sampling_of(body: Mapping[str, Any], max_tokens_limit: int) -> Sampling:
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
    return Sampling(max_tokens, temperature, top_p, tuple(stop), seed)


def kv_format_in(
    body: Mapping[str, Any], default: KVFormat | None, kernel: KVKernel = "cpu",
    head_dim: int | None = None, group_size: int = DEFAULT_KV_GROUP_SIZE,
) -> KVFormat | None:  # fmt: skip
    """The request's KV format: the `tandem` extension's `kv_bits` (16 or 0: full precision)
    and `kv_group_size`, each the node's default where it is absent or null (`kv_bits` 8
    alone takes the node's group size, `group_size`, even where the node's own default is
    full precision; a group size alone, the node's bits). A group size must divide the
    model's `head_dim` (groups run along each head's vector)."""
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
    )


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}]")
    return float(value)


# ---------------------------------------------------------------- response shapes


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chunk(req: Completion, model: str, delta: Any, finish: str | None) -> dict[str, Any]:
    """One streamed piece: a chat delta (`{"content": ...}`) or a completion's text."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if req.chat:
        choice["delta"] = delta
    else:
        choice["text"] = delta
        choice["logprobs"] = None
    return {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def text_chunk(req: Completion, model: str, text: str) -> dict[str, Any]:
    return chunk(req, model, {"content": text} if req.chat else text, None)


def reply(
    req: Completion, model: str, text: str, finish: str, n_tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """The whole (non-streamed) reply, with usage and the `tandem` object."""
    if req.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": req.request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(len(req.tokens), n_tokens),
        "tandem": extra,
    }
