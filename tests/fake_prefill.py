"""A prefill node under the test's control: it proves the token, then misbehaves on purpose."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from aiohttp import web
from tandem.nodes.contract.frames import PROTO, FrameWriter, Header
from tandem.nodes.model import fingerprint, load_index
from tandem.nodes.trust.hello import HelloResponder

from tests.trust_support import add_hello_routes

MODES = ("zeros", "503", "409", "error_frame", "garbage", "die", "hang")


@dataclass
class FakePrefill:
    mode: str
    url: str = ""
    prefills: list[str] = field(default_factory=list)  # request ids that reached /v1/prefill
    auth_headers: list[str] = field(default_factory=list)  # paths that got a bearer token
    signed: list[str] = field(default_factory=list)  # paths that got signature headers
    runner: web.AppRunner | None = None

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def start_fake_prefill(model: Path, token: str, mode: str) -> FakePrefill:
    index = load_index(model)
    fp, spec = fingerprint(index), index.spec
    fake = FakePrefill(mode)

    @web.middleware
    async def record(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        if "Authorization" in request.headers:
            fake.auth_headers.append(request.path)
        if "X-Tandem-Signature" in request.headers:
            fake.signed.append(request.path)
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        model = {"name": spec.name, "fingerprint": fp, "layers": spec.num_layers}
        return web.json_response(
            {"status": "ok", "id": "fake", "name": "fake", "roles": ["prefill"],
             "proto": PROTO, "model": model}
        )  # fmt: skip

    async def prefill(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["request_id"].startswith("probe-") and fake.mode != "zeros":
            mode_now = "zeros"  # let the router's calibration probe succeed
        else:
            fake.prefills.append(body["request_id"])
            mode_now = fake.mode
        if mode_now == "503":
            return web.json_response({"error": {}}, status=503, headers={"Retry-After": "1"})
        if mode_now == "409":
            return web.json_response({"error": {}}, status=409)
        start, n = body["start"], len(body["tokens"]) - body["start"]
        h = Header(PROTO, fp, body["request_id"], "F32", spec.num_layers, start, n,
                   spec.num_kv_heads, spec.head_dim)  # fmt: skip
        w = FrameWriter(h)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if mode_now == "garbage":
            await resp.write(b"\x07" * 64)
            return resp
        await resp.write(w.start())
        zeros = np.zeros(h.shape(0), np.float32).tobytes()
        await resp.write(w.layer(0, zeros, zeros))
        if mode_now == "error_frame":
            await resp.write(w.error("internal", "out of memory"))
            return resp
        if mode_now == "die":
            request.transport.close()  # type: ignore[union-attr]
            return resp
        if mode_now == "hang":
            await asyncio.sleep(3600)
        for i in range(1, spec.num_layers):
            await resp.write(w.layer(i, zeros, zeros))
        await resp.write(w.done())
        return resp

    app = web.Application(middlewares=[record])
    app.router.add_get("/health", health)
    add_hello_routes(app, HelloResponder(token, "fake", fp, ""))  # proves as a node does
    app.router.add_post("/v1/prefill", prefill)
    fake.runner = web.AppRunner(app, shutdown_timeout=0.5)
    await fake.runner.setup()
    site = web.TCPSite(fake.runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    return fake
