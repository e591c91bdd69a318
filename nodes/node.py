"""One tandem node process: roles + one aiohttp app + peers (DESIGN.md `tandem node`).

`create_app(config)` builds the app; the heavy halves are imported only for their role
(torch for prefill, mlx for decode), so a Mac decode node starts without torch and a CUDA
prefill node without mlx. Background work lives in `cleanup_ctx` and is cancelled on exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
from aiohttp import web

from nodes import __version__
from nodes.auth import auth_middleware, check_bind
from nodes.discovery import Advert, Discovery, url_for
from nodes.events import EventBus, sse
from nodes.model.fingerprint import fingerprint
from nodes.model.index import ModelIndex, load_index
from nodes.peers import Peer, PeerTable, hello_answer

log = logging.getLogger(__name__)
PROTO = 1
MAX_BODY_BYTES = 1024 * 1024  # JSON bodies; a 128k-token prompt is ~1 MB of ids
Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class NodeConfig:
    model: Path
    roles: tuple[Role, ...] = ("prefill", "decode")
    host: str = "127.0.0.1"
    port: int = 8470
    name: str = ""
    node_id: str = ""
    token: str | None = None
    budget: int | None = None
    host_budget: int | None = None
    max_prompt_tokens: int | None = None  # activations reserved in the budget (cuda: 8192)
    chunk_tokens: int = 512
    device: str | None = None
    link_gbps: float | None = None
    net_gbps: float | None = None
    peers: tuple[str, ...] = ()
    mdns: bool = True
    remote_prefill: Literal["auto", "always", "never"] = "auto"
    queue_limit: int = 32
    remote_timeout_s: float = 300.0
    extra: dict[str, Any] = field(default_factory=dict)


def node_id_for(port: int, config_dir: Path) -> str:
    """A stable id per (machine user, port), kept in the user's config dir."""
    path = config_dir / "nodes" / f"{port}.id"
    try:
        return path.read_text().strip()
    except OSError:
        pass
    node_id = uuid.uuid4().hex[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_id + "\n")
    return node_id


class Node:
    """Shared state of one node: identity, model, events, peers, and its services."""

    def __init__(self, config: NodeConfig, index: ModelIndex, fp: str) -> None:
        self.config = config
        self.index = index
        self.fingerprint = fp
        self.id = config.node_id or uuid.uuid4().hex[:16]
        self.name = config.name or f"{socket.gethostname()}:{config.port}"
        self.events = EventBus(self.id)
        self.peers = PeerTable(self.id, fp, config.token, PROTO)
        self.session: aiohttp.ClientSession | None = None
        self.prefill: Any = None  # nodes.prefill.server.PrefillService
        self.decode: Any = None  # nodes.decode.api.DecodeService
        self.discovery: Discovery | None = None
        self.device = "cpu"
        self.budget_bytes = 0
        self.address = url_for(config.host, config.port)
        self.tasks: list[asyncio.Task[None]] = []  # background work, cancelled on shutdown

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "id": self.id,
            "name": self.name,
            "roles": list(self.config.roles),
            "proto": PROTO,
            "version": __version__,
            "device": self.device,
            "mem_bytes": _mem_bytes(),
            "budget_bytes": self.budget_bytes,
            "model": {
                "name": self.index.spec.name,
                "fingerprint": self.fingerprint,
                "layers": self.index.spec.num_layers,
            },
        }

    def self_peer(self) -> Peer:
        h = self.health()
        rate = self.prefill.prefill_tok_s if self.prefill is not None else None
        return Peer(
            address=self.address,
            id=self.id,
            name=self.name,
            roles=tuple(self.config.roles),
            device=self.device,
            mem_bytes=h["mem_bytes"],
            budget_bytes=self.budget_bytes,
            model={"name": self.index.spec.name, "fingerprint": self.fingerprint},
            proto=PROTO,
            trusted=True,
            reason=None,
            last_seen=0.0,
            prefill_tok_s=rate,
        )


NODE = web.AppKey("node", Node)


def _mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


async def health(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].health())


async def hello(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        answer = hello_answer(node.config.token, node.id, node.fingerprint, await request.json())
    except ValueError as e:
        return web.json_response({"error": {"message": str(e), "code": "bad_request"}}, status=400)
    return web.json_response(answer)


async def events(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    since: float | None = None
    if "since" in request.query:
        try:
            since = float(request.query["since"])
        except ValueError:
            return web.json_response({"error": {"message": "since must be a number"}}, status=400)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    await response.write(b": tandem events\n\n")
    async for event in node.events.subscribe(since):
        await response.write(sse(event))
    return response


async def cluster(request: web.Request) -> web.Response:
    node = request.app[NODE]
    peers = [p.to_json() for p in node.peers.peers.values()]
    return web.json_response({"self": node.self_peer().to_json(), "peers": peers})


def create_app(config: NodeConfig) -> web.Application:
    """The node's aiohttp application; models load in its startup context."""
    check_bind(config.host, config.token)
    index = load_index(config.model)
    node = Node(config, index, fingerprint(index))
    app = web.Application(
        middlewares=[auth_middleware(config.token)], client_max_size=MAX_BODY_BYTES
    )
    app[NODE] = node
    app.router.add_get("/health", health)
    app.router.add_post("/v1/hello", hello)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/cluster", cluster)
    if "prefill" in config.roles:
        app.router.add_post("/v1/prefill", _late(lambda: node.prefill.handle))
    if "decode" in config.roles:
        app.router.add_get("/v1/models", _late(lambda: node.decode.models))
        app.router.add_post("/v1/chat/completions", _late(lambda: node.decode.chat_completions))
        app.router.add_post("/v1/completions", _late(lambda: node.decode.completions))
    app.cleanup_ctx.append(_lifecycle)
    return app


def _late(get: Any) -> Any:
    """A handler resolved at call time: services are built in the startup context."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await get()(request)

    return handler


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE]
    config = node.config
    node.session = aiohttp.ClientSession()
    try:
        if "prefill" in config.roles:
            await _start_prefill(node)
        if "decode" in config.roles:
            await _start_decode(node)
        for url in config.peers:
            node.peers.add(url)
        await node.peers.start(node.session)
        if config.mdns:
            advert = Advert.from_health(node.health(), config.host, config.port)
            node.discovery = Discovery(advert, node.peers, node.session)
            await node.discovery.start()
        yield
    finally:
        for task in node.tasks:
            task.cancel()
        await asyncio.gather(*node.tasks, return_exceptions=True)
        if node.discovery is not None:
            await node.discovery.stop()
        await node.peers.stop()
        if node.decode is not None:
            node.decode.host.close()
        if node.prefill is not None:
            await asyncio.get_running_loop().run_in_executor(None, node.prefill.close)
        await node.session.close()


async def _start_prefill(node: Node) -> None:
    from nodes.prefill.engine import PrefillEngine
    from nodes.prefill.server import PrefillService

    c = node.config

    def build() -> PrefillEngine:
        return PrefillEngine(
            node.index,
            budget=c.budget,
            device=c.device,
            chunk_tokens=c.chunk_tokens,
            link_gbps=c.link_gbps,
            host_budget=c.host_budget,
            max_prompt_tokens=c.max_prompt_tokens,
            events=node.events,
        )

    engine = await asyncio.get_running_loop().run_in_executor(None, build)
    node.prefill = PrefillService(engine, node.fingerprint, node.events, c.queue_limit, c.net_gbps)
    node.device = str(engine.device)
    node.budget_bytes = engine.budget


async def _start_decode(node: Node) -> None:
    from nodes.decode.api import DecodeService
    from nodes.decode.host import ModelHost

    host = ModelHost(node.config.model)
    await host.start()
    node.decode = DecodeService(
        host,
        node.index.spec,
        node.fingerprint,
        node.events,
        node.peers,
        node.config.token,
        node.config.remote_prefill,
        max_tokens_limit=node.index.spec.max_position_embeddings,
    )
    node.decode.remote_timeout_s = node.config.remote_timeout_s
    await node.decode.calibrate()
    node.tasks.append(asyncio.create_task(node.decode.probe_peers(), name="probe-peers"))
    if "prefill" not in node.config.roles:
        node.device = "mlx"


async def serve(config: NodeConfig) -> None:
    """Run a node until SIGINT/SIGTERM, then close tasks, children and sockets."""
    app = create_app(config)
    # handler_cancellation: a client that disconnects cancels its handler (and its decode).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    log.info("node %s serving on %s", app[NODE].name, app[NODE].address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.cleanup()
