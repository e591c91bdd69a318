"""One tandem node process: roles + one aiohttp app + peers (DESIGN.md `tandem node`).

`create_app(config)` builds the app: the node's own routes (`routes.py`), its roles' routes,
the one middleware (`errors.py`: the auth gate, then the error body); `serve` runs it behind
the connection limits (`connections.py`). The heavy halves are imported only for their role
(torch for prefill, mlx for decode), so a Mac decode node starts without torch and a CUDA
prefill node without mlx. Background work lives in `cleanup_ctx` and is cancelled on exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from aiohttp import web
from tandem.nodes import __version__
from tandem.nodes.cluster.discovery import Advert, Discovery, url_for
from tandem.nodes.cluster.peers import PeerTable
from tandem.nodes.contract.cluster import (
    DecodeGroup,
    GroupRank,
    Health,
    ModelLayer,
    Peer,
    WeightTiers,
    model_label,
)
from tandem.nodes.contract.events import EventBus
from tandem.nodes.contract.http import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_PREFILL_QUEUE,
    DEFAULT_REMOTE_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    MAX_BODY_BYTES,
    PROTO,
    KVFormat,
    check_group_size,
)
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.fingerprint import fingerprint
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.kv_bytes import latent_widths, state_tensors
from tandem.nodes.model.locate import source_of
from tandem.nodes.prefill.planning.ram import DEFAULT_HOST_BUDGET, HostBudget
from tandem.nodes.serve.connections import EdgeLimits, EdgeRunner
from tandem.nodes.serve.errors import node_middleware
from tandem.nodes.serve.metrics import NodeMetrics
from tandem.nodes.serve.prefill_side import prefill_service, start_prefill
from tandem.nodes.serve.readings import NodeReadings
from tandem.nodes.serve.routes import NodeRoutes
from tandem.nodes.trust.auth import Gate, check_bind, is_loopback
from tandem.nodes.trust.hello import HelloResponder
from tandem.nodes.trust.tls import Identity, TLSError, load_or_create, server_context

if TYPE_CHECKING:  # the heavy halves load only for their role
    from tandem.nodes.decode.service import DecodeService
    from tandem.nodes.prefill.serving.server import PrefillService

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]


class ListenError(Exception):
    """The node's address cannot be bound (in use, not this machine's, not allowed)."""


@dataclass(frozen=True)
class NodeConfig:
    model: Path
    roles: tuple[Role, ...] = ("prefill", "decode")
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    name: str = ""
    node_id: str = ""
    token: str | None = None
    budget: int | None = None
    host_budget: HostBudget | None = DEFAULT_HOST_BUDGET  # the RAM tier (prefill/ram.py)
    prefix_cache: HostBudget = "auto"  # the prefill node's prefix cache (prefill/ram.py)
    max_prompt_tokens: int | None = None  # activations reserved in the budget (cuda: 8192)
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    device: str | None = None
    link_gbps: float | None = None
    net_gbps: float | None = None
    peers: tuple[str, ...] = ()
    mdns: bool = True
    remote_prefill: Literal["auto", "always", "never"] = "auto"
    queue_limit: int = DEFAULT_PREFILL_QUEUE
    remote_timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # prefill: a reader that takes nothing
    max_batch_tokens: int | None = None  # prefill: a pass's prompt tokens (None: the reserve's)
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # decode: generations at once
    max_queue: int = DEFAULT_MAX_QUEUE  # decode: generations waiting, then 503
    kv_bits: int | None = None  # decode: KV quantized on the wire by default (8 or 4)
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    tls: bool = False  # serve HTTPS on loopback too (beyond loopback it always does)
    tls_dir: Path | None = None  # where this node's certificate and key live (per port)
    limits: EdgeLimits = field(default_factory=EdgeLimits)  # what one client connection holds
    group: Any = None  # decode: rank 0 of a group mlx.launch started (group/launch.GroupLaunch)
    ranks: tuple[int, int, int] | None = None  # prefill: (rank, ranks, local rank) of torchrun's
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def serves_tls(self) -> bool:
        return self.tls or not is_loopback(self.host)


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

    def __init__(
        self, config: NodeConfig, index: ModelIndex, fp: str, identity: Identity | None = None
    ) -> None:
        self.config = config
        self.index = index
        self.fingerprint = fp
        self.revision = source_of(config.model).revision  # "": not a hub snapshot
        self.id = config.node_id or uuid.uuid4().hex[:16]
        self.instance = secrets.token_hex(8)  # this process: peers see a restart in /health
        self.identity = identity  # the TLS certificate it serves; None: plain HTTP
        self.cert_fingerprint = identity.fingerprint if identity is not None else ""
        self.hello = HelloResponder(config.token, self.id, fp, self.cert_fingerprint)
        self.name = config.name or f"{socket.gethostname()}:{config.port}"
        self.events = EventBus(self.id)
        # `/metrics`: this node's own registry, fed by its bus, its services and its health
        self.metrics = NodeMetrics(self.health, config.roles, index.spec.name)
        self.events.listen(self.metrics.on_event)
        label = model_label(index.spec.name, self.revision)
        self.peers = PeerTable(self.id, fp, config.token, PROTO, model=label)
        self.session: aiohttp.ClientSession | None = None
        self.prefill: PrefillService | None = None
        self.decode: DecodeService | None = None
        self.discovery: Discovery | None = None
        self.device = "cpu"
        self.budget_bytes = 0
        self.tiers: WeightTiers | None = None  # the prefill engine's, once it has started
        self.readings = NodeReadings(self.events.publish)  # the card's, mlx's gauges: events too
        self.address = url_for(config.host, config.port, identity is not None)
        self.tasks: list[asyncio.Task[None]] = []  # background work, cancelled on shutdown

    def health(self) -> Health:
        spec = self.index.spec
        return Health(
            id=self.id, name=self.name, roles=tuple(self.config.roles), proto=PROTO,
            version=__version__, device=self.device, mem_bytes=_mem_bytes(),
            budget_bytes=self.budget_bytes, model_name=spec.name, fingerprint=self.fingerprint,
            layers=spec.num_layers, instance=self.instance, cert_fingerprint=self.cert_fingerprint,
            model_revision=self.revision,
            layer_kinds=tuple(ModelLayer(k.kind, k.window) for k in spec.layer_kinds),
            tiers=self.tiers, group=self.group,
            batching=self.decode.batching() if self.decode is not None else None,
            queue=self.prefill.queue() if self.prefill is not None else None,
            gpu=self.readings.gpu(), mlx_memory=self.readings.mlx_memory(),
            prefill_ranks=self.prefill.ranks() if self.prefill is not None else None,
        )  # fmt: skip

    @property
    def group(self) -> DecodeGroup | None:
        """The decode group this node is rank 0 of, once its ranks loaded; None otherwise."""
        rank0 = self.decode.host.group if self.decode is not None else None
        if rank0 is None:
            return None
        ranks = tuple(GroupRank(s.rank, s.host, s.layers, s.weight_bytes, s.mem_bytes)
                      for s in rank0.shares)  # fmt: skip
        return DecodeGroup(rank0.size, rank0.backend, ranks, rank0.lost or "")

    def self_peer(self) -> Peer:
        rate = self.prefill.prefill_tok_s if self.prefill is not None else None
        return Peer(
            address=self.address,
            id=self.id,
            name=self.name,
            roles=tuple(self.config.roles),
            device=self.device,
            mem_bytes=_mem_bytes(),
            budget_bytes=self.budget_bytes,
            model={
                "name": self.index.spec.name,
                "fingerprint": self.fingerprint,
                "revision": self.revision,
            },
            proto=PROTO,
            trusted=True,
            reason=None,
            last_seen=0.0,
            prefill_tok_s=rate,
            group=self.group,
        )


NODE = web.AppKey("node", Node)


def _mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def create_app(config: NodeConfig) -> web.Application:
    """The node's aiohttp application; models load in its startup context."""
    check_bind(config.host, config.token)
    index = load_index(config.model)
    node = Node(config, index, fingerprint(index), _identity(config))
    app = web.Application(
        middlewares=[node_middleware(Gate(config.token, node.id))],
        client_max_size=MAX_BODY_BYTES,
    )
    app[NODE] = node
    NodeRoutes(node).add_routes(app)
    if "prefill" in config.roles:
        node.prefill = prefill_service(node)
        app.router.add_post("/v1/prefill", node.prefill.handle)
    if "decode" in config.roles:
        if "prefill" not in config.roles:
            keep_torch_out()
        from tandem.nodes.decode.api import DecodeApi

        node.decode = _decode_service(node)
        DecodeApi(node.decode).add_routes(app)
    app.cleanup_ctx.append(_lifecycle)
    return app


def _identity(config: NodeConfig) -> Identity | None:
    """The TLS identity a node serving TLS presents (made on its first start); TLSError."""
    if not config.serves_tls:
        return None
    if config.tls_dir is None:
        raise TLSError("serving TLS needs a directory for the certificate (NodeConfig.tls_dir)")
    me = socket.gethostname()
    hosts = (config.host, me, f"{me.split('.')[0]}.local", "localhost", "127.0.0.1", "::1")
    return load_or_create(config.tls_dir, config.name or f"tandem-{config.node_id}", hosts)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    node = app[NODE]
    config = node.config
    node.session = aiohttp.ClientSession()
    try:
        if "prefill" in config.roles:
            await start_prefill(node)
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
            await node.prefill.stop()
            await asyncio.get_running_loop().run_in_executor(None, node.prefill.close)
        await asyncio.get_running_loop().run_in_executor(None, node.readings.close)
        await node.session.close()


def keep_torch_out() -> None:
    """A decode-only node never computes with torch, but mlx-lm imports transformers, which
    imports torch wherever it is installed (~3 s and ~300 MB on a Linux box). Marked absent
    before mlx-lm loads, transformers finds no torch and leaves it."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


def _decode_service(node: Node) -> DecodeService:
    from tandem.nodes.decode.families.base import KVShape
    from tandem.nodes.decode.host import ModelHost
    from tandem.nodes.decode.lm import device_kernel
    from tandem.nodes.decode.service import DecodeService

    spec, c = node.index.spec, node.config
    dtype = node.index.dtype
    expect = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype,
                     state_tensors(spec, dtype), latent_widths(spec))  # fmt: skip
    quantized = c.kv_bits and not spec.float_kv  # sinks, latents: mlx-lm holds floats only
    kv_format = KVFormat(c.kv_bits, c.kv_group_size, device_kernel()) if quantized else None
    if kv_format is not None:
        try:
            check_group_size(kv_format.group_size, spec.head_dim)
        except ValueError as e:
            raise ModelError(f"--kv-group-size: {e}") from None
    return DecodeService(
        ModelHost(c.model, c.group), spec, expect, node.fingerprint, node.events, node.peers,
        c.remote_prefill, max_tokens_limit=spec.max_position_embeddings,
        max_concurrent=c.max_concurrent, max_queue=c.max_queue,
        remote_timeout_s=c.remote_timeout_s, kv_format=kv_format,
        kv_group_size=c.kv_group_size, metrics=node.metrics.decode,
    )  # fmt: skip


async def _start_decode(node: Node) -> None:
    assert node.decode is not None
    await node.decode.start()
    await node.readings.watch_mlx()
    if node.decode.mode == "auto":  # only `auto` weighs the local rate (`always`/`never` don't)
        await node.decode.calibrate()
    node.tasks.append(asyncio.create_task(node.decode.probe_peers(), name="probe-peers"))
    if "prefill" not in node.config.roles:
        node.device = "mlx"


async def serve(config: NodeConfig) -> None:
    """Run a node until SIGINT/SIGTERM, then close tasks, children and sockets."""
    try:
        app = create_app(config)
    except TLSError as e:
        raise ListenError(f"cannot serve TLS: {e}") from None
    identity = app[NODE].identity
    # handler_cancellation: a client that disconnects cancels its handler (and its decode).
    runner = EdgeRunner(
        app, config.limits, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
    )
    await runner.setup()
    tls = server_context(identity) if identity is not None else None
    site = web.TCPSite(runner, config.host, config.port, ssl_context=tls)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {config.host}:{config.port}: {e.strerror}") from e
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
