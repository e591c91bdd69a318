"""The routes every node serves, whatever its roles: `/health`, the hello pair, `/v1/events`,
`/v1/cluster` and `/metrics` (the roles add theirs: `/v1/prefill`, the OpenAI routes).

A refusal raises `ApiError`; the node's middleware (`errors.py`) answers it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from aiohttp import web
from tandem.nodes.contract.events import sse
from tandem.nodes.contract.http import ApiError
from tandem.nodes.serve.errors import read_json_body
from tandem.nodes.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tandem.nodes.trust.auth import CONFIRM_PATH, HELLO_PATH, METRICS_PATH
from tandem.nodes.trust.hello import HelloRefused

# a hello's body: nonces, ids and a proof (a few hundred bytes); no token is needed to send
# one, so nobody gets to make this node hold more
HELLO_MAX_BYTES = 4096

if TYPE_CHECKING:
    from tandem.nodes.serve.node import Node


class NodeRoutes:
    """A node's own routes over its shared state."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_post(HELLO_PATH, self.hello)
        app.router.add_post(CONFIRM_PATH, self.hello_confirm)
        app.router.add_get("/v1/events", self.events)
        app.router.add_get("/v1/cluster", self.cluster)
        app.router.add_get(METRICS_PATH, self.metrics)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(self.node.health().to_json())

    async def hello(self, request: web.Request) -> web.Response:
        """Hello v2, the callee's answer (nodes/trust/hello.py)."""
        body = await read_json_body(request, "bad_request", HELLO_MAX_BYTES)
        try:
            answer = self.node.hello.answer(body, _sockname(request))
        except ValueError as e:
            raise ApiError(400, str(e), "bad_request") from None
        return web.json_response(answer)

    async def hello_confirm(self, request: web.Request) -> web.Response:
        """Hello v2, the caller's proof: 200 once it verifies, else 401."""
        body = await read_json_body(request, "bad_request", HELLO_MAX_BYTES)
        try:
            caller = self.node.hello.confirm(body, _sockname(request))
        except HelloRefused as e:
            raise ApiError(401, str(e), "unauthorized") from None
        except ValueError as e:
            raise ApiError(400, str(e), "bad_request") from None
        return web.json_response({"id": self.node.id, "caller": caller, "proven": True})

    async def events(self, request: web.Request) -> web.StreamResponse:
        since: float | None = None
        if "since" in request.query:
            try:
                since = float(request.query["since"])
                if not math.isfinite(since):
                    raise ValueError(since)
            except ValueError:
                raise ApiError(400, "since must be a number", "bad_request") from None
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            await response.write(b": tandem events\n\n")
            async for event in self.node.events.subscribe(since):
                await response.write(sse(event))
        except ConnectionError:  # the client left: nothing to say (it was a traceback)
            pass
        return response

    async def cluster(self, request: web.Request) -> web.Response:
        node = self.node
        peers = [p.to_json() for p in node.peers.peers.values()]
        return web.json_response({"self": node.self_peer().to_json(), "peers": peers})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus's scrape (`metrics.py`): guarded by the token as `/v1/*` is."""
        body = self.node.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


def _sockname(request: web.Request) -> Any:
    """This side's address of the request's connection (what a plain hello binds)."""
    transport = request.transport
    return transport.get_extra_info("sockname") if transport else None
