"""Who a node is and whom it knows: the `GET /health` and `GET /v1/cluster` records.

Each record has one parser, `from_json`, which raises `ContractError` for a body that is not
the record, and `to_json`, the exact wire shape. A missing key takes its default (an older
node's body, which lacks a newer key, still reads); a key of the wrong type is an error.
Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

from tandem.nodes.contract.fields import as_body as _body
from tandem.nodes.contract.fields import read_int as _int
from tandem.nodes.contract.fields import read_object as _object
from tandem.nodes.contract.fields import read_rate as _rate
from tandem.nodes.contract.fields import read_roles as _roles
from tandem.nodes.contract.fields import read_str as _str
from tandem.nodes.contract.gauges import Gauges, read_gauges
from tandem.nodes.contract.http import ContractError, Reason
from tandem.nodes.contract.ranks import PrefillRanks, read_prefill_ranks

Source = Literal["static", "mdns"]  # `--peer URL`, or found by mDNS (nodes/cluster/discovery)


@dataclass(frozen=True)
class ModelLayer:
    """One decoder layer as `/health` tells it (nodes/model's `LayerKind` on the wire): what
    its attention keeps. A kind not known here (a newer node's) reads as written."""

    kind: str = "full"  # "full", "sliding" (K/V of the last `window` positions), "linear"
    window: int | None = None  # positions kept: "sliding" only

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "window": self.window}


def _layers(model: dict[str, Any], what: str) -> tuple[ModelLayer, ...]:
    """`model.layer_kinds`: one {"kind", "window"} per layer; () from a node that says none."""
    items = model.get("layer_kinds")
    if items is None:
        return ()
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ContractError(f"{what} layer_kinds is not a list of objects")
    out = []
    for item in items:
        window = item.get("window")
        if window is not None and (type(window) is not int or window < 1):
            raise ContractError(f"{what} layer window is not a positive integer")
        out.append(ModelLayer(_str(item, "kind", what) or "full", window))
    return tuple(out)


@dataclass(frozen=True)
class WeightTiers:
    """Where a prefill node's weights are during a warm pass (bytes): `device`, resident on the
    device; `ram`, streamed each pass from its RAM tier (`--host-budget`); `disk`, streamed
    each pass from disk."""

    device: int = 0
    ram: int = 0
    disk: int = 0

    def to_json(self) -> dict[str, int]:
        return {"device": self.device, "ram": self.ram, "disk": self.disk}


def _tiers(obj: dict[str, Any], what: str) -> WeightTiers | None:
    """`tiers`: None from a node that says none (an older one, or no prefill role)."""
    if obj.get("tiers") is None:
        return None
    tiers = _object(obj, "tiers", what)
    return WeightTiers(
        _int(tiers, "device", what), _int(tiers, "ram", what), _int(tiers, "disk", what)
    )


@dataclass(frozen=True)
class GroupRank:
    """One rank of a decode group: where it runs and which layers it holds."""

    rank: int
    host: str
    layers: tuple[int, int]  # [first, end)
    weight_bytes: int
    mem_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "layers": list(self.layers),
                "weight_bytes": self.weight_bytes, "mem_bytes": self.mem_bytes}  # fmt: skip


@dataclass(frozen=True)
class DecodeGroup:
    """A decode node run as `mx.distributed` ranks (`mlx.launch`): its layers split by
    pipeline, rank 0 the node that serves."""

    size: int
    backend: str  # "ring", "jaccl", ...
    ranks: tuple[GroupRank, ...]
    lost: str = ""  # why the group is gone (a rank exited or froze); "" while it runs

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "backend": self.backend,
                "ranks": [r.to_json() for r in self.ranks], "lost": self.lost}  # fmt: skip


@dataclass(frozen=True)
class Batching:
    """How a decode node runs its replies at once (issue 46): `continuous`, every reply whose
    caches mlx-lm can merge steps in one batch (mlx-lm's `BatchGenerator`; a decode group's
    ranks batch alike); `interleaved`, each reply takes one step in turn (no node of this
    version says it). `unbatched` says what steps beside the batch, a step a tick, and why."""

    mode: str  # "continuous" | "interleaved"
    running: int  # replies generating now
    waiting: int  # replies queued for a slot
    limit: int  # replies at once (--max-concurrent)
    batch: int  # replies in the last batch step
    unbatched: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "running": self.running, "waiting": self.waiting,
                "limit": self.limit, "batch": self.batch, "unbatched": self.unbatched}  # fmt: skip


@dataclass(frozen=True)
class PrefillQueue:
    """A prefill node's queue (issue 46): prefills waiting for the next pass and their
    tokens, and the pass in progress (its requests and tokens; 0: none). A decode node's
    router counts the wait."""

    waiting: int = 0
    tokens_waiting: int = 0
    running_tokens: int = 0
    running: int = 0

    def to_json(self) -> dict[str, int]:
        return {"waiting": self.waiting, "tokens_waiting": self.tokens_waiting,
                "running_tokens": self.running_tokens, "running": self.running}  # fmt: skip

    @property
    def tokens(self) -> int:
        """Tokens ahead of a request that joins now."""
        return self.tokens_waiting + self.running_tokens


def _queue(obj: dict[str, Any], what: str) -> PrefillQueue | None:
    """`queue`: None from a node without the prefill role (or an older one)."""
    if obj.get("queue") is None:
        return None
    q = _object(obj, "queue", what)
    w = f"{what} queue"
    return PrefillQueue(_int(q, "waiting", w), _int(q, "tokens_waiting", w),
                        _int(q, "running_tokens", w), _int(q, "running", w))  # fmt: skip


def _batching(obj: dict[str, Any], what: str) -> Batching | None:
    """`batching`: None from a node without the decode role (or an older one)."""
    if obj.get("batching") is None:
        return None
    b = _object(obj, "batching", what)
    w = f"{what} batching"
    return Batching(
        _str(b, "mode", w), _int(b, "running", w), _int(b, "waiting", w), _int(b, "limit", w),
        _int(b, "batch", w), _str(b, "unbatched", w),
    )  # fmt: skip


def _has(obj: dict[str, Any], keys: tuple[str, ...], what: str) -> None:
    """A group is newer than every node that lacks one of its keys: none takes a default."""
    missing = [k for k in keys if obj.get(k) is None]
    if missing:
        raise ContractError(f"{what} lacks {', '.join(missing)}")


def _group(obj: dict[str, Any], what: str) -> DecodeGroup | None:
    """`group`: None from a node of one process (or an older one)."""
    if obj.get("group") is None:
        return None
    g = _object(obj, "group", what)
    _has(g, ("size", "backend", "ranks"), f"{what} group")
    items = g.get("ranks")
    if not isinstance(items, list) or not all(isinstance(r, dict) for r in items):
        raise ContractError(f"{what} group.ranks is not a list of objects")
    ranks = []
    for r in items:
        _has(r, ("rank", "host", "layers", "weight_bytes", "mem_bytes"), f"{what} group rank")
        span = r.get("layers")
        if not (isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)):
            raise ContractError(f"{what} group rank layers is not [first, end]")
        ranks.append(GroupRank(
            _int(r, "rank", what), _str(r, "host", what), (span[0], span[1]),
            _int(r, "weight_bytes", what), _int(r, "mem_bytes", what),
        ))  # fmt: skip
    return DecodeGroup(_int(g, "size", what), _str(g, "backend", what), tuple(ranks),
                       _str(g, "lost", what))  # fmt: skip


@dataclass(frozen=True)
class Health:
    """`GET /health` (no auth, no secret): who a node is and what it runs."""

    id: str
    name: str
    roles: tuple[str, ...]
    proto: int
    version: str
    device: str
    mem_bytes: int
    budget_bytes: int
    model_name: str
    fingerprint: str
    layers: int
    instance: str = ""  # random per process: a restart (or another process) changes it
    cert_fingerprint: str = ""  # hex sha256 of the TLS certificate it serves; "" on plain HTTP
    layer_kinds: tuple[ModelLayer, ...] = ()  # one per layer; () from an older node: unknown
    tiers: WeightTiers | None = None  # a prefill node's weights by tier; None: not said
    group: DecodeGroup | None = None  # a decode node run as a group of ranks
    batching: Batching | None = None  # a decode node's replies at once; None: not said
    queue: PrefillQueue | None = None  # a prefill node's queue; None: not said
    # the Hugging Face snapshot its model directory is (the commit hash); "": another folder
    model_revision: str = ""
    gpu: Gauges | None = None  # the card's own counters (contract/gauges.py); None: not said
    mlx_memory: Gauges | None = None  # mlx's memory on a decode node; None: not said
    prefill_ranks: PrefillRanks | None = None  # a prefill node of several devices (ranks.py)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": "ok", "id": self.id, "name": self.name, "roles": list(self.roles),
            "proto": self.proto, "version": self.version, "device": self.device,
            "mem_bytes": self.mem_bytes, "budget_bytes": self.budget_bytes,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint,
                      "layers": self.layers, "revision": self.model_revision,
                      "layer_kinds": [k.to_json() for k in self.layer_kinds]},
            "instance": self.instance, "cert_fingerprint": self.cert_fingerprint,
            "tiers": self.tiers.to_json() if self.tiers is not None else None,
            "group": self.group.to_json() if self.group is not None else None,
            "batching": self.batching.to_json() if self.batching is not None else None,
            "queue": self.queue.to_json() if self.queue is not None else None,
            "gpu": self.gpu, "mlx_memory": self.mlx_memory,
            "prefill_ranks": self.prefill_ranks.to_json() if self.prefill_ranks else None,
        }  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> Health:
        """A node's `/health` body; ContractError when it is not one."""
        w = "/health"
        obj = _body(obj, w)
        model = _object(obj, "model", w)
        return cls(
            id=_str(obj, "id", w), name=_str(obj, "name", w), roles=_roles(obj, w),
            proto=_int(obj, "proto", w), version=_str(obj, "version", w),
            device=_str(obj, "device", w), mem_bytes=_int(obj, "mem_bytes", w),
            budget_bytes=_int(obj, "budget_bytes", w), model_name=_str(model, "name", w),
            fingerprint=_str(model, "fingerprint", w), layers=_int(model, "layers", w),
            model_revision=_str(model, "revision", w),
            instance=_str(obj, "instance", w), cert_fingerprint=_str(obj, "cert_fingerprint", w),
            layer_kinds=_layers(model, w), tiers=_tiers(obj, w), group=_group(obj, w),
            batching=_batching(obj, w), queue=_queue(obj, w), gpu=read_gauges(obj, "gpu", w),
            mlx_memory=read_gauges(obj, "mlx_memory", w),
            prefill_ranks=read_prefill_ranks(obj, w),
        )  # fmt: skip


MODEL_KEYS = ("name", "fingerprint", "revision")  # a Peer's `model`; "revision" optional


def model_label(name: str, revision: str) -> str:
    """A node's model as a mismatch names it: `org/name@<commit>` for a Hugging Face
    snapshot (`revision`: `/health`'s `model.revision`), else `local directory <name>`."""
    return f"{name}@{revision[:12]}" if revision else f"local directory {name}"


@dataclass(frozen=True)
class Peer:
    """One node as `/v1/cluster` shows it (DESIGN.md Peer shape): what its `/health` said,
    whether the reporting node trusts it (and why not), and the rates it measured. The peer
    table (nodes/cluster/peers.py) keeps one per address."""

    address: str
    id: str = ""
    name: str = ""
    roles: tuple[str, ...] = ()
    device: str = ""
    mem_bytes: int = 0
    budget_bytes: int = 0
    model: dict[str, str] = field(default_factory=dict)  # {"name", "fingerprint", "revision"?}
    proto: int = 0
    trusted: bool = False
    reason: Reason | None = "unreachable"
    last_seen: float = 0.0
    prefill_tok_s: float | None = None
    link_Bps: float | None = None
    prefill_floor_s: float | None = None  # the cheapest remote pass seen (weights + HTTP)
    source: Source = "static"
    group: DecodeGroup | None = None  # a decode node run as ranks, as its `/health` says
    queue: PrefillQueue | None = None  # a prefill node's queue at its last health check
    # not on the wire: the peer process's `/health` instance, which the peer table keeps to
    # see a restart
    instance: str = ""
    cert_fingerprint: str = ""  # pinned by the hello (an mDNS claim until then); "" plain

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "roles": list(self.roles),
            "address": self.address,
            "device": self.device,
            "mem_bytes": self.mem_bytes,
            "budget_bytes": self.budget_bytes,
            "model": dict(self.model),
            "proto": self.proto,
            "trusted": self.trusted,
            "reason": self.reason,
            "last_seen": self.last_seen,
            "prefill_tok_s": self.prefill_tok_s,
            "link_Bps": self.link_Bps,
            "prefill_floor_s": self.prefill_floor_s,
            "source": self.source,
            "cert_fingerprint": self.cert_fingerprint,
            "group": self.group.to_json() if self.group is not None else None,
            "queue": self.queue.to_json() if self.queue is not None else None,
        }

    @classmethod
    def from_json(cls, obj: Any) -> Peer:
        """One peer of a `/v1/cluster` body; ContractError when it is not one."""
        obj = _body(obj, "a /v1/cluster peer")
        w = "/v1/cluster peer"
        model = _object(obj, "model", w)
        if not isinstance(obj.get("trusted", False), bool):
            raise ContractError(f"{w} trusted is not true or false")
        return cls(
            address=_str(obj, "address", w), id=_str(obj, "id", w), name=_str(obj, "name", w),
            roles=_roles(obj, w), device=_str(obj, "device", w),
            mem_bytes=_int(obj, "mem_bytes", w), budget_bytes=_int(obj, "budget_bytes", w),
            model={k: _str(model, k, w) for k in MODEL_KEYS if k in model},
            proto=_int(obj, "proto", w), trusted=obj.get("trusted", False),
            reason=cast(Reason, _str(obj, "reason", w) or None),
            last_seen=_rate(obj, "last_seen", w) or 0.0,
            prefill_tok_s=_rate(obj, "prefill_tok_s", w), link_Bps=_rate(obj, "link_Bps", w),
            prefill_floor_s=_rate(obj, "prefill_floor_s", w),
            source="mdns" if obj.get("source") == "mdns" else "static",
            cert_fingerprint=_str(obj, "cert_fingerprint", w), group=_group(obj, w),
            queue=_queue(obj, w),
        )  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """`GET /v1/cluster`: the node itself (`me`, `"self"` on the wire) and the peers it knows."""

    me: Peer | None
    peers: tuple[Peer, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "self": self.me.to_json() if self.me is not None else None,
            "peers": [p.to_json() for p in self.peers],
        }

    @classmethod
    def from_json(cls, obj: Any) -> Cluster:
        """A `/v1/cluster` body; ContractError when it is not an object with a list of
        peers. An entry that is not a peer (a newer node's, or junk) is left out, as
        `event_from_json` leaves out an event of a kind not known here."""
        obj = _body(obj, "/v1/cluster")
        peers = obj.get("peers") or []
        if not isinstance(peers, list):
            raise ContractError("/v1/cluster peers is not a list")
        return cls(_peer_or_none(obj.get("self")), tuple(filter(None, map(_peer_or_none, peers))))


def _peer_or_none(obj: Any) -> Peer | None:
    try:
        return Peer.from_json(obj)
    except ContractError:
        return None
