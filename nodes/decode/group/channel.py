"""Rank 0's orders to the other ranks of a decode group, over `mx.distributed` itself.

An order is a JSON object (its op, its arguments, the arrays that follow: name, dtype, shape)
and then those arrays, each sent as an `all_sum` to which only rank 0 adds anything (exact:
x + 0 is x). Every rank takes part in every order, in the same sequence, so the ring backend
(which talks to neighbours only) serves any group size. The other ranks wait in `receive`
between orders.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


@dataclass(frozen=True)
class Order:
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, mx.array] = field(default_factory=dict)


def _name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # "mlx.core.float32" -> "float32"


def _dtype(name: str) -> Any:
    dtype = getattr(mx, name, None)
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"an order names dtype {name!r}")
    return dtype


class Channel:
    """Rank 0 `send`s, the others `receive`, in lockstep."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()

    def _all_sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def send(self, op: str, args: Mapping[str, Any] | None = None,
             arrays: Mapping[str, mx.array] | None = None) -> None:  # fmt: skip
        """On rank 0: one order to every other rank."""
        arrays = dict(arrays or {})
        listed = [
            [name, str(a.dtype).rsplit(".", 1)[-1], list(a.shape)] for name, a in arrays.items()
        ]
        head = json.dumps({"op": op, "args": dict(args or {}), "arrays": listed}).encode()
        self._all_sum(mx.array([len(head)], dtype=mx.int32))
        self._all_sum(mx.array(list(head), dtype=mx.uint8))
        for a in arrays.values():
            self._all_sum(a)

    def receive(self) -> Order:
        """On any other rank: the next order (waits for it)."""
        n = int(self._all_sum(mx.zeros((1,), dtype=mx.int32)).item())
        raw = self._all_sum(mx.zeros((n,), dtype=mx.uint8))
        head = json.loads(bytes(raw.tolist()))
        arrays = {
            name: self._all_sum(mx.zeros(tuple(shape), dtype=_dtype(dtype)))
            for name, dtype, shape in head["arrays"]
        }
        return Order(head["op"], head["args"], arrays)
