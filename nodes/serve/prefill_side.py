"""A node's prefill side: its service built around the engine (on one device, or as rank 0
of several, `prefill/ranks/`), and a rank other than 0, which serves no port."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.nodes.contract.cluster import WeightTiers

if TYPE_CHECKING:
    from tandem.nodes.model.index import ModelIndex
    from tandem.nodes.prefill.engine import PrefillEngine
    from tandem.nodes.prefill.serving.server import PrefillService
    from tandem.nodes.serve.node import Node, NodeConfig


def engine_args(c: NodeConfig) -> dict[str, Any]:
    """The engine's settings from the node's (every rank's alike)."""
    return {
        "budget": c.budget, "chunk_tokens": c.chunk_tokens, "link_gbps": c.link_gbps,
        "host_budget": c.host_budget, "prefix_cache": c.prefix_cache,
        "max_prompt_tokens": c.max_prompt_tokens,
    }  # fmt: skip


def ranked_engine(index: ModelIndex, c: NodeConfig, **kwargs: Any) -> PrefillEngine:
    """The engine on the node's device, or, under torchrun, this rank's on its own device,
    joined to the others (`Collective`)."""
    from tandem.nodes.prefill.engine import PrefillEngine

    if c.ranks is None:
        return PrefillEngine(index, device=c.device, **engine_args(c), **kwargs)
    import torch
    from tandem.nodes.prefill.planning.ram import spare_ram
    from tandem.nodes.prefill.ranks.collective import Collective, rank_device
    from tandem.nodes.prefill.ranks.events import relay_events

    rank, world, local = c.ranks
    device = rank_device(c.device, local)
    collective = Collective.start(rank, world, torch.device(device))
    args = engine_args(c)
    if c.host_budget == "auto":  # the machine's spare RAM, a share each (all at once)
        args["host_budget"] = spare_ram() // world
    if rank:
        args["prefix_cache"] = None  # rank 0's alone
    engine = PrefillEngine(index, device=device, collective=collective, **args, **kwargs)
    collective.describe(engine, c.link_gbps)
    # rank 0's engine publishes on the node's bus (`events`): the others' events join it there
    collective.relay = relay_events(collective, engine.events)
    return engine


def prefill_service(node: Node) -> PrefillService:
    from tandem.nodes.prefill.serving.server import PrefillService

    c = node.config

    def build() -> PrefillEngine:
        return ranked_engine(node.index, c, events=node.events)

    return PrefillService(build, node.fingerprint, node.events, c.queue_limit, c.net_gbps,
                          c.stall_timeout_s, c.max_batch_tokens, node.metrics.prefill)  # fmt: skip


async def start_prefill(node: Node) -> None:
    assert node.prefill is not None
    engine = await node.prefill.start()
    node.device = str(engine.device)
    node.budget_bytes = engine.budget
    plan = engine.plan
    node.tiers = WeightTiers(plan.resident_bytes, plan.ram_bytes, plan.disk_bytes)
    await node.readings.watch_gpu(node.device)


def follow_prefill(index: ModelIndex, c: NodeConfig) -> int:
    """A prefill rank other than 0: its share of the weights, rank 0's passes until it stops."""
    from tandem.nodes.prefill.ranks.follower import follow

    engine = ranked_engine(index, c)
    try:
        follow(engine)
    finally:
        engine.close()
        assert engine.collective is not None
        engine.collective.close()
    return 0
