"""The node a hello test talks to (issue 19): a fake callee with /health, the hello and one
protected route behind the real auth middleware, and the TLS identities the tests pin."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from tandem.nodes.contract.cluster import Health
from tandem.nodes.contract.http import PROTO
from tandem.nodes.serve.errors import node_middleware
from tandem.nodes.trust.auth import Gate
from tandem.nodes.trust.hello import HelloResponder
from tandem.nodes.trust.tls import Identity, load_or_create

from tests.trust_support import add_hello_routes, serving

TOKEN = "hello-test-token-0123456789abcdef"
FP = "f" * 64
CALLEE = "callee-node"


@dataclass
class FakeCallee:
    """A node as far as trust goes: /health, the hello, and one protected route (/v1/echo)
    behind the real auth middleware. Records every request it gets."""

    token: str | None = TOKEN
    identity: Identity | None = None
    instance: str = "i-1"
    hold: asyncio.Event | None = None  # when set to an unset event, hellos wait for it
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        cert = self.identity.fingerprint if self.identity else ""
        responder = HelloResponder(self.token, CALLEE, FP, cert)
        self.responder = responder

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.seen.append((request.path, dict(request.headers)))
            return await handler(request)

        async def health(request: web.Request) -> web.Response:
            h = Health(
                CALLEE, "callee", ("prefill",), PROTO, "0", "cpu", 0, 0, "m", FP, 2,
                instance=self.instance, cert_fingerprint=cert,
            )  # fmt: skip
            return web.json_response(h.to_json())

        async def held() -> None:
            if self.hold is not None:
                await self.hold.wait()

        async def cluster(request: web.Request) -> web.Response:
            return web.json_response({"self": {"id": CALLEE}, "peers": []})

        async def echo(request: web.Request) -> web.Response:
            return web.json_response({"body": (await request.read()).decode()})

        app = web.Application(middlewares=[record, node_middleware(Gate(self.token, CALLEE))])
        app.router.add_get("/health", health)
        add_hello_routes(app, responder, held)
        app.router.add_route("*", "/v1/echo", echo)
        app.router.add_get("/v1/cluster", cluster)
        return app

    def paths(self) -> list[str]:
        return [p for p, _ in self.seen]


@asynccontextmanager
async def callee(identity: Identity | None = None, **kw: Any) -> AsyncIterator[FakeCallee]:
    fake = FakeCallee(identity=identity, **kw)
    async with serving(fake.app(), identity) as url:
        fake.url = url
        yield fake


@pytest.fixture(scope="module")
def ident(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return load_or_create(tmp_path_factory.mktemp("callee-tls"), "callee")


@pytest.fixture(scope="module")
def other_ident(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return load_or_create(tmp_path_factory.mktemp("other-tls"), "impostor")
