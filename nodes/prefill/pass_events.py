"""What a pass tells the dashboard (`LayerEvent`, `LinkEvent`), for each of its requests:
each layer queued, loading, ready, computing and evicted, and the bytes the loader moved
(once, as the pass's first request's: the link carried them once)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.nodes.contract.events import EventBus, LayerEvent, LinkEvent
from tandem.nodes.prefill.planning.loads import Load
from tandem.nodes.prefill.stream.movers import FillTimes
from tandem.nodes.prefill.stream.streamer import LayerStreamer, LoaderHooks


class PassEvents:
    def __init__(self, events: EventBus, streamer: LayerStreamer) -> None:
        self.events, self.streamer = events, streamer

    def layer(self, rid: str, load: Load, state: str, nbytes: int = 0) -> LayerEvent:
        """Request `rid`'s event for `load`'s layer in `state`."""
        return LayerEvent(
            rid,
            layer=load.layer,
            state=state,  # type: ignore[arg-type]
            slot=self.streamer.slot_of(load),
            pinned=load.resident,
            bytes=nbytes or load.nbytes,
        )

    def publish(self, rid: str, load: Load, state: str) -> None:
        self.events.publish(self.layer(rid, load, state))

    def routed(
        self, rids: list[str], loads: Sequence[Load], layer: int, used: frozenset[int], total: int
    ) -> None:
        """Layer `layer`'s router chose experts `used` of `total`: the bytes its streamed loads
        read of them, to every request of the pass."""
        nbytes = sum(pc.nbytes for ld in loads if ld.layer == layer and ld.routed
                     and not ld.resident for p in ld.parts if p.lo in used
                     for pc in p.pieces)  # fmt: skip
        for rid in rids:
            self.events.publish(LayerEvent(rid, layer=layer, state="routed", bytes=nbytes,
                                           experts=len(used), experts_total=total))  # fmt: skip

    def queued(self, rid: str, layers: int, resident: tuple[int, ...]) -> None:
        """Every layer of a new request, queued (a resident layer pinned)."""
        for i in range(layers):
            self.events.publish(LayerEvent(rid, layer=i, state="queued", pinned=i in resident))

    def hooks(self, rids: list[str]) -> LoaderHooks:
        """A pass's loads told to each of its requests; the bytes moved once (the first's)."""
        return LoaderHooks(on_loading=self.on_loading(rids), on_ready=self.on_ready(rids))

    def on_loading(self, rids: list[str]) -> Callable[[Load, int | None], None]:
        def hook(load: Load, slot: int | None) -> None:
            for rid in rids:
                self.events.publish(self.layer(rid, load, "loading"))

        return hook

    def on_ready(self, rids: list[str]) -> Callable[[Load, int | None, FillTimes], None]:
        def hook(load: Load, slot: int | None, t: FillTimes) -> None:
            publish = self.events.publish
            if t.disk_bytes:
                publish(LinkEvent(rids[0], name="disk", bytes=t.disk_bytes, seconds=t.disk_s))
            publish(LinkEvent(rids[0], name="h2d", bytes=t.nbytes, seconds=t.h2d_s))
            for rid in rids:
                publish(self.layer(rid, load, "ready", t.nbytes))

        return hook
