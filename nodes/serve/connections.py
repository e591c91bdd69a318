"""What one client connection may hold of a node, before any route runs (issue 33).

- A request's head (request line and headers) arrives within `head_timeout_s` of the
  connection opening or of its first byte, else the connection closes (slowloris).
- A request's body arrives whole within `body_timeout_s` of its head, else the connection
  closes (a slow body, authenticated or not, holds nothing for long; issue 47).
- A kept-alive connection with no request closes after `idle_timeout_s`.
- One address holds at most `connections_per_address` connections; a request on one past
  that is answered 503 `too_many_connections` and the connection closes.
- A request line or header field over `max_field_bytes`, or more than `max_headers` header
  fields, is answered 431 in the contract's error body; any other malformed head 400. The
  answer and the log name the limit and echo nothing of what was sent (aiohttp's own answer
  quotes the line, a token included, and logs it with a traceback).

aiohttp has no public hook for its per-connection protocol, so its internals used here
(`RequestHandler`'s request factory and handler slots, `Server`'s kwargs, `AppRunner`'s
server factory) are used in this module only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from tandem.nodes.contract.http import error_body

log = logging.getLogger(__name__)

DEFAULT_HEAD_TIMEOUT_S: Final = 5.0  # request line + headers, from the first byte
# a body, from its head: a 1 MiB body (the most any route takes) at 1 Mbit/s is 8 s
DEFAULT_BODY_TIMEOUT_S: Final = 10.0
DEFAULT_LINGER_S: Final = 1.0  # an unread body after the answer, read and dropped this long
# longer than the clients' own pools keep an idle connection (aiohttp's 15 s), so a client
# never reuses a connection the node is closing
DEFAULT_IDLE_TIMEOUT_S: Final = 30.0
# above a decode node's generations running and waiting (8 + 128): its own 503 comes first
DEFAULT_CONNECTIONS_PER_ADDRESS: Final = 256
MAX_FIELD_BYTES: Final = 8190  # a request line or one header field (aiohttp's default)
MAX_HEADERS: Final = 128  # header fields in one request (aiohttp's default)


@dataclass(frozen=True)
class EdgeLimits:
    """How long and how much one client may hold a node (module docstring)."""

    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    linger_s: float = DEFAULT_LINGER_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    connections_per_address: int = DEFAULT_CONNECTIONS_PER_ADDRESS
    max_field_bytes: int = MAX_FIELD_BYTES
    max_headers: int = MAX_HEADERS

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's own per-connection settings for these limits."""
        return {
            "keepalive_timeout": self.idle_timeout_s,
            # a body a route left unread (refused before it) is read and dropped for at most
            # `linger_s`, so that its sender can finish sending and read the answer, then the
            # connection closes (aiohttp's default lingers 10 s)
            "lingering_time": self.linger_s,
            "max_line_size": self.max_field_bytes,
            "max_field_size": self.max_field_bytes,
            "max_headers": self.max_headers,
        }


def refusal(exc: HttpProcessingError, limits: EdgeLimits) -> tuple[int, dict[str, Any]]:
    """The status and error body for a head aiohttp's parser refused: it names the limit and
    quotes nothing the client sent (aiohttp's messages quote the offending line)."""
    if isinstance(exc, LineTooLong):
        message = f"a request line or header field is over {limits.max_field_bytes} bytes"
        return 431, error_body(message, "header_too_large")
    if "Too many headers" in exc.message:
        message = f"more than {limits.max_headers} header fields"
        return 431, error_body(message, "header_too_large")
    kind = type(exc).__name__  # the class only: the message may quote the request
    return 400, error_body(f"malformed HTTP request ({kind})", "bad_request")


class EdgeHandler(RequestHandler):
    """aiohttp's connection protocol, with the head timeout, the per-address cap and the
    parse errors of `EdgeLimits`."""

    def __init__(self, manager: EdgeServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = manager.limits
        self._open = manager.open_per_address
        self._address: str | None = None
        self._in_request = False  # a head arrived; its response is not finished yet
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        factory = self._request_factory
        assert factory is not None

        def head_arrived(*args: Any) -> Any:  # every parsed head passes here, errors too
            self._in_request = True
            self._stop_head_timer()
            request = factory(*args)
            self._start_body_timer(request)
            return request

        self._request_factory = head_arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        self._open[self._address] += 1
        if self._open[self._address] > self._limits.connections_per_address:
            self._request_handler = self._over_cap
        self._start_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        self._stop_body_timer()
        if self._address is not None:
            self._open[self._address] -= 1
            if self._open[self._address] <= 0:
                del self._open[self._address]
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and not self._in_request and self._head_timer is None:
            self._start_head_timer()  # the first byte of the next request on this connection
        super().data_received(data)

    async def finish_response(
        self, request: Any, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._in_request = False
            self._stop_body_timer()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A head (or body framing) aiohttp refused: the contract's error body, logged by its
        class and limit only. Anything else is aiohttp's (a handler's own failure)."""
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        status, body = refusal(exc, self._limits)
        log.info("refused a request from %s: %s", self._address, body["error"]["message"])
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("response already started; cannot send the error")
        response = web.json_response(body, status=status)
        response.force_close()
        return response

    async def _over_cap(self, request: web.BaseRequest) -> web.StreamResponse:
        cap = self._limits.connections_per_address
        body = error_body(f"more than {cap} connections from this address", "too_many_connections")
        response = web.json_response(body, status=503, headers={"Retry-After": "1"})
        response.force_close()
        return response

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self._loop.call_later(self._limits.head_timeout_s, self._head_late)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _start_body_timer(self, request: Any) -> None:
        self._stop_body_timer()
        payload = getattr(request, "content", None)
        if payload is None or payload.is_eof():
            return  # no body, or all of it here already

        def late() -> None:
            self._body_timer = None
            if not payload.is_eof():
                log.info("closed a connection from %s: its request body did not arrive in "
                         "%.0f s", self._address, self._limits.body_timeout_s)  # fmt: skip
                self.force_close()

        self._body_timer = self._loop.call_later(self._limits.body_timeout_s, late)

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self._in_request:
            log.debug("closed a connection from %s: no request head in time", self._address)
            self.force_close()


class EdgeServer(web.Server):
    """aiohttp's server whose connections are `EdgeHandler`s, counted per address."""

    def __init__(self, handler: Any, *, limits: EdgeLimits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.open_per_address: collections.Counter[str] = collections.Counter()

    def __call__(self) -> RequestHandler:
        return EdgeHandler(self, loop=self._loop, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """`web.AppRunner` serving the app through an `EdgeServer` with `limits`."""

    def __init__(self, app: web.Application, limits: EdgeLimits, **kwargs: Any) -> None:
        super().__init__(app, **limits.handler_args(), **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app's startup runs here
        return EdgeServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            limits=self.limits,
            **server._kwargs,
        )
