"""Nodes in a test's hands for the trust tests (issue 19): the hello routes answered by the
real `HelloResponder` (a fake holding the token proves it exactly as a node does), a relay,
a record of what an attacker's server got, and serving an app on loopback, plain or TLS."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from tandem.nodes.cluster.mdns_records import url_for
from tandem.nodes.trust.auth import CONFIRM_PATH, HELLO_PATH
from tandem.nodes.trust.hello import HelloRefused, HelloResponder
from tandem.nodes.trust.signing import SIGNATURE
from tandem.nodes.trust.tls import Identity, server_context


def add_hello_routes(
    app: web.Application,
    responder: HelloResponder,
    before: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """`POST /v1/hello` and `/v1/hello/confirm` on `app`; `before` is awaited first in each
    hello (a test holds hellos back with it)."""

    async def hello(request: web.Request) -> web.Response:
        if before is not None:
            await before()
        sockname = request.transport.get_extra_info("sockname")  # type: ignore[union-attr]
        return web.json_response(responder.answer(await request.json(), sockname))

    async def confirm(request: web.Request) -> web.Response:
        try:
            sockname = request.transport.get_extra_info("sockname")  # type: ignore[union-attr]
            caller = responder.confirm(await request.json(), sockname)
        except HelloRefused as e:
            return web.json_response({"error": {"message": str(e)}}, status=401)
        return web.json_response({"id": responder.own_id, "caller": caller, "proven": True})

    app.router.add_post(HELLO_PATH, hello)
    app.router.add_post(CONFIRM_PATH, confirm)


@dataclass
class Log:
    """Every request a server got: path and headers."""

    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def middleware(self) -> web.middleware:
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append((request.path, dict(request.headers)))
            return await handler(request)

        return record

    def assert_nothing_usable(self, token: str) -> None:
        """Neither `token` nor any signature reached this server, nor a request a signature
        would be for, nor a caller's proof."""
        for path, headers in self.requests:
            assert "Authorization" not in headers, path
            assert SIGNATURE not in headers, path
            assert token not in json.dumps(headers), path
        assert "/v1/prefill" not in self.paths
        assert CONFIRM_PATH not in self.paths  # nobody proved the token to it


def relay(target: str, log: Log) -> web.Application:
    """A node holding no token that passes /health and the hello on to `target` (a node
    that holds it) and keeps whatever else it is sent."""

    async def forward(request: web.Request) -> web.Response:
        async with (
            aiohttp.ClientSession() as s,
            s.request(
                request.method,
                target + request.path,
                data=await request.read(),
                ssl=False,
                headers={"Content-Type": request.headers.get("Content-Type", "")},
            ) as r,
        ):
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def keep(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "relay"}}, status=500)

    app = web.Application(middlewares=[log.middleware()])
    for path in ("/health", HELLO_PATH, CONFIRM_PATH):
        app.router.add_route("*", path, forward)
    app.router.add_route("*", "/{tail:.*}", keep)
    return app


@asynccontextmanager
async def serving(
    app: web.Application, identity: Identity | None = None, port: int = 0, host: str = "127.0.0.1"
) -> AsyncIterator[str]:
    """Serve `app` on `host`:`port` (loopback and a free port by default; TLS with
    `identity`); yields its base URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    tls = server_context(identity) if identity is not None else None
    site = web.TCPSite(runner, host, port, ssl_context=tls, reuse_address=True)
    await site.start()
    try:
        yield url_for(host, runner.addresses[0][1], identity is not None)
    finally:
        await runner.cleanup()
