"""How every route of both roles reads a body and refuses a request: one body reader that
enforces the size limit, and one middleware that lets in whom the `Gate` admits and answers
`ApiError` (and aiohttp's own 404/405/413) with the contract's error body, never aiohttp's
text/plain.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from tandem.nodes.contract.http import ApiError, BadBody, error_body, read_json
from tandem.nodes.trust.auth import Gate

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_KEPT_HEADERS = ("allow", "retry-after")  # what an aiohttp refusal says that a client needs


async def read_json_body(
    request: web.Request, code: str = "bad_json", max_bytes: int | None = None
) -> Any:
    """The request's body as JSON (`contract.read_json`); ApiError 413 past the app's
    `client_max_size` (`MAX_BODY_BYTES`) or `max_bytes` (a route that needs no token takes a
    few KiB: refused before a byte of a larger body is read), 400 with `code` when it is not
    JSON the node reads."""
    if max_bytes is not None and (request.content_length or 0) > max_bytes:
        raise ApiError(413, f"request body too large (over {max_bytes} bytes)",
                       "request_too_large")  # fmt: skip
    try:
        if max_bytes is not None and request.content_length is None:  # chunked: read a cap
            raw = await request.content.read(max_bytes + 1)
            if len(raw) > max_bytes or not request.content.is_eof():
                raise ApiError(413, f"request body too large (over {max_bytes} bytes)",
                               "request_too_large")  # fmt: skip
        else:
            raw = await request.read()  # aiohttp keeps the bytes: a second read gets the same
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, _too_large(request), "request_too_large") from None
    except web.RequestPayloadError:  # its framing: chunked encoding, compression
        raise ApiError(400, "the request body is malformed", "bad_request") from None
    try:
        return read_json(raw)
    except BadBody as e:
        raise ApiError(400, str(e), code) from None


def node_middleware(gate: Gate | None = None) -> web.middleware:
    """The node's one middleware: the `gate` (who may call), then the handler; a refusal,
    ours or aiohttp's, in the one error body."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if gate is not None:
                await gate.admit(request)
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = _too_large(request) if e.status == 413 else e.reason
            body = error_body(message, _CODES.get(e.status, "http_error"))
            headers = {k: v for k, v in e.headers.items() if k.lower() in _KEPT_HEADERS}
            return web.json_response(body, status=e.status, headers=headers)

    return middleware


def _too_large(request: web.Request) -> str:
    return f"request body too large (over {request.client_max_size} bytes)"
