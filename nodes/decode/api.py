"""The decode node's OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions`,
`/v1/completions`, streamed (SSE) or not, each reply carrying the `tandem` object.

A handler reads the body (`contract.read_json`), parses it (`openai_api`), takes a slot
(`DecodeService.admitted`) and writes what `DecodeService.run` yields: text pieces as SSE
chunks, or the whole reply at the end. A client that disconnects cancels its generation and
its remote prefill (aiohttp cancels the handler; `run` is closed, the mlx thread stops).
A generation that fails ends a stream with an error chunk, a plain reply with a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from aiohttp import web
from tandem.nodes.contract.http import SSE_DONE, ApiError, error_body, sse_encode
from tandem.nodes.decode import harmony
from tandem.nodes.decode import openai_api as oa
from tandem.nodes.decode import openai_shapes as shapes
from tandem.nodes.decode.completion import Finished, GenerationFailed
from tandem.nodes.decode.openai_api import Completion
from tandem.nodes.decode.openai_tools import split_tool_calls, tools_of
from tandem.nodes.decode.service import DecodeService
from tandem.nodes.serve.errors import read_json_body

log = logging.getLogger(__name__)


class DecodeApi:
    """The OpenAI routes over one `DecodeService`."""

    def __init__(self, service: DecodeService) -> None:
        self.service = service

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)

    async def models(self, request: web.Request) -> web.Response:
        name = self.service.model_name
        model = {"id": name, "object": "model", "created": 0, "owned_by": "tandem"}
        return web.json_response({"object": "list", "data": [model]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        s = self.service
        s.refuse_if_lost()
        body = await json_body(request)
        if not s.host.has_chat_template:
            raise ApiError(400, "this model has no chat template (a base model): send a prompt "
                           "to /v1/completions instead", "no_chat_template")  # fmt: skip
        takes_tools = s.supports_tools or self.writes_harmony
        oa.check_fields(body, chat=True, tools=takes_tools)
        messages = oa.messages_of(body, tools=takes_tools)
        tools = tools_of(body) if takes_tools else None
        sampling = oa.sampling_of(body, s.max_tokens_limit, s.spec.vocab_size, chat=True)
        kv_format = s.kv_format_in(body)
        # off the mlx thread: a long prefill there must not hold up the next chat's template
        tokens = await asyncio.to_thread(s.host.chat_tokens, messages, tools)
        context = s.spec.max_position_embeddings
        req = oa.completion(body, tokens, sampling, True, context, kv_format, tools)
        return await self._respond(request, req)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        s = self.service
        s.refuse_if_lost()
        body = await json_body(request)
        oa.check_fields(body, chat=False)
        prompt = oa.prompt_of(body, s.spec.vocab_size)
        sampling = oa.sampling_of(body, s.max_tokens_limit, s.spec.vocab_size, chat=False)
        kv_format = s.kv_format_in(body)
        tokens = (
            prompt if isinstance(prompt, list) else await asyncio.to_thread(s.host.encode, prompt)
        )
        context = s.spec.max_position_embeddings
        req = oa.completion(body, tokens, sampling, False, context, kv_format)
        return await self._respond(request, req)

    @functools.cached_property
    def writes_harmony(self) -> bool:
        """Whether the model writes Harmony (gpt-oss): its chat replies are split by channel
        (harmony.py) and its template takes tools. Asked at the first chat, the model loaded."""
        return harmony.speaks_harmony(self.service.host.tokenizer.get_vocab())

    async def _respond(self, request: web.Request, req: Completion) -> web.StreamResponse:
        async with self.service.admitted():  # ApiError 503 when the queue is full
            if req.stream:
                return await self._stream(request, req)
            return await self._whole(req)

    async def _whole(self, req: Completion) -> web.Response:
        text: list[str] = []
        try:
            async with contextlib.aclosing(self.service.run(req)) as items:
                async for item in items:
                    if isinstance(item, Finished):
                        gen = item.generation
                        content, calls, reasoning = self._split(req, "".join(text))
                        body = shapes.reply(
                            req, self.service.model_name, content, gen.finish_reason,
                            gen.tokens, item.tandem, gen.logprobs, calls, reasoning,
                        )  # fmt: skip
                        return web.json_response(body)
                    text.append(item)
        except GenerationFailed as e:
            raise ApiError(e.status, str(e), e.code) from None
        raise AssertionError("a completion ends with Finished")  # pragma: no cover

    def _split(self, req: Completion, text: str) -> tuple[str, list[dict[str, Any]], str]:
        """(content, tool calls, reasoning) of a reply: a Harmony chat reply split by channel
        (its calls kept where the request gave tools); else the calls parsed out where the
        request gave tools, by the model's own tool parser (mlx-lm's tokenizer)."""
        if req.chat and self.writes_harmony:
            reply = harmony.parse(text)
            if reply.tool_calls and req.tools is None:
                log.warning("a Harmony reply calls %d tools the request gave none of; dropped",
                            len(reply.tool_calls))  # fmt: skip
            calls = [c.openai() for c in reply.tool_calls] if req.tools is not None else []
            return reply.content, calls, reply.reasoning
        if req.tools is None:
            return text, [], ""
        tok = self.service.host.tokenizer
        content, calls = split_tool_calls(
            text, tok.tool_call_start, tok.tool_call_end, tok.tool_parser, req.tools
        )
        return content, calls, ""

    async def _stream(self, request: web.Request, req: Completion) -> web.StreamResponse:
        model = self.service.model_name
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if req.chat:
            await response.write(
                sse_encode(shapes.chunk(req, model, {"role": "assistant", "content": ""}, None))
            )
        split = harmony.HarmonyStream() if req.chat and self.writes_harmony else None
        try:
            async with contextlib.aclosing(self.service.run(req)) as items:
                async for item in items:
                    if isinstance(item, Finished):
                        if split is not None:
                            await _write_deltas(response, req, model, split.finish())
                        gen = item.generation
                        last = shapes.chunk(req, model, {} if req.chat else "", gen.finish_reason)
                        last["usage"] = shapes.usage(len(req.tokens), gen.tokens)
                        last["tandem"] = item.tandem
                        await response.write(sse_encode(last))
                    elif split is not None:
                        await _write_deltas(response, req, model, split.feed(item))
                    else:
                        await response.write(sse_encode(shapes.text_chunk(req, model, item)))
        except GenerationFailed as e:
            await response.write(sse_encode(error_body(str(e), e.code)))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


async def _write_deltas(
    response: web.StreamResponse, req: Completion, model: str, events: list[harmony.Event]
) -> None:
    """A Harmony reply's text as it comes, in `content` or `reasoning` deltas (a stream takes
    no tools, so a call it makes is dropped)."""
    for e in events:
        if isinstance(e, harmony.Delta):
            await response.write(sse_encode(shapes.chunk(req, model, {e.field: e.text}, None)))
        else:
            log.warning("a streamed Harmony reply calls %s; a stream takes no tools: dropped",
                        e.name)  # fmt: skip


async def json_body(request: web.Request) -> dict[str, Any]:
    """A request's JSON object body; ApiError (400/413) for anything else."""
    body = await read_json_body(request, "invalid_request_error")
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    return body
