"""A decode group's other ranks (1..N-1): no port, no events; each repeats rank 0's steps
(`mirror.py`) on its own layers, order by order, until rank 0 says stop or the group ends.

Its caches are kept by the id rank 0 gave them; a frame for one of its layers arrives as an
order's arrays and is filled by the model's decode family, as rank 0 fills its own.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families import family_for
from tandem.nodes.decode.families.base import LayerArrays
from tandem.nodes.decode.group.batch import SeqBatch
from tandem.nodes.decode.group.channel import Channel, Order
from tandem.nodes.decode.group.pipeline import Stage
from tandem.nodes.decode.lm import device_kernel
from tandem.nodes.model.spec import ModelSpec

log = logging.getLogger(__name__)


class Follower:
    """One rank's stage and caches, driven by rank 0's orders."""

    def __init__(self, channel: Channel, stage: Stage, spec: ModelSpec) -> None:
        self.channel, self.stage, self.spec = channel, stage, spec
        self.family = family_for(spec.family)
        self.first = stage.layers_range[0]
        self.caches: dict[int, lm.Caches] = {}
        self.saved: dict[int, lm.Caches] = {}  # what a failed fill goes back to, by id
        self.batch = SeqBatch()  # the caches of the replies stepping together, as rank 0's

    def run(self) -> None:
        """Take orders until "stop"."""
        while True:
            order = self.channel.receive()
            if order.op == "stop":
                return
            self.take(order)

    def take(self, order: Order) -> None:
        a, caches = order.args, self.caches
        if order.op == "new":
            caches[a["id"]] = self.stage.make_cache()
        elif order.op == "forward":
            cache = caches[a["id"]] if a["id"] is not None else None
            out = self.stage(order.arrays["tokens"], cache)
            mx.eval(out, *(c.state for c in cache or []))
        elif order.op == "batch":
            batch = self.batch.sync(a["ids"], caches)
            out = self.stage(order.arrays["tokens"], batch)
            mx.eval(out, [c.state for c in batch])
        elif order.op == "unbatch":
            caches[a["id"]] = self.batch.leave(a["id"])
        elif order.op == "quantize":
            lm.quantize_when_due(caches[a["id"]], self._format(a))
        elif order.op == "trim":
            lm.trim_to(caches[a["id"]], a["k"])
        elif order.op == "clone":
            caches[a["id"]] = lm.clone_prefix(caches[a["src"]], a["k"])
        elif order.op == "replace":
            caches[a["id"]] = list(caches[a["src"]])
        elif order.op == "save":
            self.saved[a["id"]] = list(caches[a["id"]])
        elif order.op == "restore":
            caches[a["id"]] = list(self.saved[a["id"]])
        elif order.op == "fill":
            self._fill(order)
        elif order.op == "free":
            for id in a["ids"]:
                caches.pop(id, None)
                self.saved.pop(id, None)
        else:
            raise ValueError(f"an order this rank does not know: {order.op!r}")

    def _format(self, a: dict[str, Any]) -> KVFormat:
        return KVFormat(a["bits"], a["group_size"], device_kernel())

    def _fill(self, order: Order) -> None:
        a = order.args
        if not self.first <= a["layer"] < self.stage.layers_range[1]:
            return  # another rank's layer (sent to it alone)
        cache_list = self.caches[a["id"]]
        layer = a["layer"]
        i = layer - self.first
        fmt = self._format(a["kv_format"]) if a["kv_format"] else None
        arrays = LayerArrays(layer, dict(order.arrays), a["end"])
        cache_list[i] = self.family.fill(self.spec.layer_kinds[layer], cache_list[i], arrays, fmt)
        mx.eval(cache_list[i].state[:2])
