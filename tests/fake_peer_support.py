"""A prefill node the discovery tests control (FakeNode): it answers `/health` and the hello
as its behaviour says and records every request; served on loopback, advertised over mDNS."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
from aiohttp import web
from tandem.nodes.contract.http import PROTO, SERVICE_TYPE
from tandem.nodes.model import fingerprint, load_index
from tandem.nodes.trust.hello import HelloResponder
from zeroconf.asyncio import AsyncServiceInfo

TOKEN = "discovery-test-token-0123456789"
OTHER_FP = "0" * 64
Behaviour = Literal["honest", "wrong_proof", "other_model", "old_proto"]


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def fp(model: Path) -> str:
    return fingerprint(load_index(model))


class FakeNode:
    """A node the test controls: answers `/health` and `/v1/hello` as `behaviour` says and
    records every request it gets, headers included."""

    def __init__(self, name: str, behaviour: Behaviour, fp: str) -> None:
        self.name = name
        self.id = f"fake-{name}"
        self.behaviour = behaviour
        self.fp = fp
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, headers)

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def model_fp(self) -> str:
        return OTHER_FP if self.behaviour == "other_model" else self.fp

    def app(self) -> web.Application:
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append((request.path, dict(request.headers)))
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/hello", self.hello)
        app.router.add_post("/v1/hello/confirm", self.confirm)
        app.router.add_route("*", "/{tail:.*}", self.refuse)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "id": self.id,
                "name": self.name,
                "roles": ["prefill"],
                "proto": PROTO + 1 if self.behaviour == "old_proto" else PROTO,
                "device": "cuda",
                "mem_bytes": 1 << 30,
                "budget_bytes": 1 << 28,
                "model": {"name": "m", "fingerprint": self.model_fp(), "layers": 4},
            }
        )

    async def hello(self, request: web.Request) -> web.Response:
        if getattr(self, "responder", None) is None or self.responder.fingerprint != (
            self.model_fp()
        ):  # one responder per model: concurrent hellos' cookies stay good at their confirms
            self.responder = HelloResponder(TOKEN, self.id, self.model_fp(), "")
        sockname = request.transport.get_extra_info("sockname")  # type: ignore[union-attr]
        answer = self.responder.answer(await request.json(), sockname)
        if self.behaviour == "wrong_proof":
            answer["proof"] = "ab" * 32
        return web.json_response(answer)

    async def confirm(self, request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname")  # type: ignore[union-attr]
        caller = self.responder.confirm(await request.json(), sockname)
        return web.json_response({"caller": caller})

    async def refuse(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "fake"}}, status=500)

    def info(self, port: int) -> AsyncServiceInfo:
        """The registration this fake advertises: the TXT keys of a real prefill node."""
        props = {
            "id": self.id,
            "name": self.name,
            "roles": "prefill",
            "proto": str(PROTO),
            "model": self.model_fp()[:16],
            "device": "cuda",
            "mem": str(1 << 30),
        }
        return AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.name}.{SERVICE_TYPE}",
            port=port,
            properties=props,
            server=f"{self.id}.local.",
            parsed_addresses=["127.0.0.1"],
        )


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """Serve `app` on a free loopback port; yields the port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
