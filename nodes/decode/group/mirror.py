"""Rank 0's side of a decode group: the model and the caches the decode node uses, each of
whose steps the other ranks repeat on their own layers (`follower.py`), in the same order.

- `GroupModel(inputs, cache)`: orders the other ranks to run the same call over their stages,
  then runs rank 0's, and evaluates it at once (the collectives inside one call must not
  interleave with the next order's).
- `GroupCaches`: rank 0's layers' caches (its layers are the last ones, from `first`), with
  the id the other ranks know theirs by. `lm`'s cache edits (`quantize_when_due`, `trim_to`,
  `clone_prefix`) and the frame fills of other ranks' layers are ordered too; a list rank 0
  drops is dropped by the others at the next order.
- Replies whose caches merge step in one batch on every rank (`batch.py`: `batch_forward`,
  `unbatch`).

Everything here runs on the decode node's mlx thread, the only one that orders.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import mlx.core as mx
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode.families.base import LayerArrays
from tandem.nodes.decode.group.batch import GroupBatch, SeqBatch
from tandem.nodes.decode.group.channel import Args, Arrays, Channel
from tandem.nodes.decode.group.pipeline import Stage


class GroupCaches(list[Any]):
    """Rank 0's layers' caches (layers `first`.. of `total`), known to the others by `id`."""

    def __init__(self, items: list[Any], mirror: Mirror, id: int) -> None:
        super().__init__(items)
        self.mirror, self.id = mirror, id
        self.first, self.total, self.kinds = mirror.first, mirror.total, mirror.kinds


class Mirror:
    """Orders for the other ranks, for each step rank 0 takes."""

    def __init__(
        self, channel: Channel, stage: Stage, kinds: frozenset[str], spans: list[tuple[int, int]]
    ) -> None:
        self.channel, self.stage, self.spans = channel, stage, spans  # spans: each rank's layers
        self.first, end = stage.layers_range
        self.total = end  # rank 0 holds the last layers
        self.kinds = kinds  # every layer kind of the model, the other ranks' too
        self._ids = itertools.count(1)
        self._dropped: list[int] = []
        self._lock = threading.RLock()  # finalizers run on any thread, even inside `order`
        self.batch = SeqBatch()  # rank 0's caches of the replies stepping together

    def order(
        self, op: str, args: Args | None = None, arrays: Arrays | None = None, to: int | None = None
    ) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        if dropped:
            self.channel.send("free", {"ids": dropped})
        self.channel.send(op, args, arrays, to)

    def _wrap(self, items: list[Any], id: int) -> GroupCaches:
        caches = GroupCaches(items, self, id)
        weakref.finalize(caches, self._drop, id)
        return caches

    def _drop(self, id: int) -> None:
        with self._lock:
            self._dropped.append(id)

    def new(self) -> GroupCaches:
        id = next(self._ids)
        self.order("new", {"id": id})
        return self._wrap(self.stage.make_cache(), id)

    def forward(self, inputs: mx.array, cache: Any) -> mx.array:
        id = cache.id if isinstance(cache, GroupCaches) else None
        self.order("forward", {"id": id}, {"tokens": inputs})
        out = self.stage(inputs, cache)
        mx.eval(out)
        return out

    def batch_forward(self, rows: list[GroupCaches], tokens: mx.array) -> mx.array:
        """One step of the replies `rows` ([B, 1] tokens, a row each) on every rank, their
        caches merged into each rank's batch where they are new to it: logits [B, 1, V]."""
        ids = [c.id for c in rows]
        self.order("batch", {"ids": ids}, {"tokens": tokens})
        cache = self.batch.sync(ids, {c.id: list(c) for c in rows})
        out = self.stage(tokens, cache)
        mx.eval(out)
        return out

    def unbatch(self, caches: GroupCaches) -> None:
        """A reply out of the batch on every rank: its caches its own again."""
        self.order("unbatch", {"id": caches.id})
        caches[:] = self.batch.leave(caches.id)

    def quantized(self, caches: GroupCaches, kv_format: KVFormat) -> None:
        self.order("quantize", {"id": caches.id, "bits": kv_format.bits,
                                "group_size": kv_format.group_size})  # fmt: skip

    def trimmed(self, caches: GroupCaches, k: int) -> None:
        self.order("trim", {"id": caches.id, "k": k})

    def clone(self, caches: GroupCaches, k: int, items: list[Any]) -> GroupCaches:
        id = next(self._ids)
        self.order("clone", {"src": caches.id, "k": k, "id": id})
        return self._wrap(items, id)

    def replace(self, caches: GroupCaches, fresh: GroupCaches) -> None:
        """`caches` take `fresh`'s contents, on every rank."""
        caches[:] = fresh
        self.order("replace", {"id": caches.id, "src": fresh.id})

    def fill(self, caches: GroupCaches, arrays: LayerArrays, kv_format: KVFormat | None) -> None:
        """Another rank's layer: its frame's arrays to it (it fills its cache as rank 0 would)."""
        fmt = {"bits": kv_format.bits, "group_size": kv_format.group_size} if kv_format else None
        args = {"id": caches.id, "layer": arrays.layer, "end": arrays.end, "kv_format": fmt}
        self.order("fill", args, arrays.tensors, to=self.owner(arrays.layer))

    def owner(self, layer: int) -> int:
        """The rank that holds `layer`."""
        return next(r for r, (first, end) in enumerate(self.spans) if first <= layer < end)

    def stop(self) -> None:
        self.order("stop")


class GroupModel:
    """The decode node's model in a group: mlx-lm's call, its cache list and layers, as rank
    0 sees them (no `model` attribute: no layer-at-a-time first step, the call runs whole)."""

    def __init__(self, stage: Stage, mirror: Mirror) -> None:
        self.stage, self.mirror = stage, mirror
        self.args = stage.model.args

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.mirror.forward(inputs, cache)

    def make_cache(self) -> GroupCaches:
        return self.mirror.new()

    def new_batch(self) -> GroupBatch:
        """The replies' batch (in place of mlx-lm's `BatchGenerator`, which would run rank
        0's layers only)."""
        return GroupBatch(self.mirror)

    @property
    def layers(self) -> list[Any]:
        return self.stage.layers

    def parameters(self) -> Any:
        return self.stage.model.parameters()
