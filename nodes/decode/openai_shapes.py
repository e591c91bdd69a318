"""OpenAI response shapes (pure: no I/O, no mlx): a reply whole, a streamed chunk, usage."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tandem.nodes.decode.openai_api import Completion, TokenLogprob


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
    req: Completion, model: str, text: str, finish: str, n_tokens: int, extra: dict[str, Any],
    logprobs: Sequence[TokenLogprob] = (), tool_calls: Sequence[dict[str, Any]] = (),
    reasoning: str = "",
) -> dict[str, Any]:  # fmt: skip
    """The whole (non-streamed) reply, with usage, the `tandem` object and, where the request
    asked, each token's log-probability. With `tool_calls` (`text`: what lies outside them)
    a stop is finish_reason "tool_calls", as in mlx-lm's server; a chat's `reasoning` (a
    Harmony reply's analysis) is the message's field of that name, as there."""
    lp = _logprobs_json(req, logprobs) if req.sampling.logprobs else None
    if req.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            finish = "tool_calls" if finish == "stop" else finish
        if reasoning:
            message["reasoning"] = reasoning
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": lp,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
    return {
        "id": req.request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(len(req.tokens), n_tokens),
        "tandem": extra,
    }


def _logprobs_json(req: Completion, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's logprobs object: chat's `content` list, or a completion's parallel lists."""
    if req.chat:

        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {**entry(t.token, t.logprob), "top_logprobs": [entry(*a) for a in t.top]}
                for t in logprobs
            ]
        }
    offsets, at = [], 0
    for t in logprobs:
        offsets.append(at)
        at += len(t.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [dict(t.top) for t in logprobs],
        "text_offset": offsets,
    }
