"""What the dashboard knows about the cluster: one row per node address, merged from our own
probes and from every node's `/v1/cluster` view of its peers.

Pure state, no Textual. `update` returns what changed in words, for notifications: a node
that joins, leaves, comes back, or is rejected (and why).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from tandem.app.tui.client import Probe, normalize
from tandem.nodes.contract.cluster import Cluster, DecodeGroup, Health, ModelLayer, WeightTiers
from tandem.nodes.contract.ranks import PrefillRanks

Status = Literal["connecting", "trusted", "rejected", "unreachable"]
Severity = Literal["information", "warning", "error"]
_PEER_REASONS = ("unauthorized", "model_mismatch", "protocol_mismatch")
REASON_TEXT = {
    "unauthorized": "holds a different token",
    "model_mismatch": "serves a different model",
    "protocol_mismatch": "speaks another protocol version",
    "unreachable": "not answering",
    "bad_reply": "answers something unexpected",
}


@dataclass(frozen=True)
class NodeRow:
    """One node on the dashboard: its last `/health` (None until one answered), the
    dashboard's verdict on it (our probe, then its trusted peers' verdicts), and the rates
    its peers measured. The node's own facts are read from `health`, never copied."""

    url: str
    health: Health | None = None
    status: Status = "connecting"
    reason: str | None = None
    prefill_tok_s: float | None = None
    link_Bps: float | None = None

    @property
    def label(self) -> str:
        return self.name or self.url

    @property
    def id(self) -> str:
        return self.health.id if self.health else ""

    @property
    def name(self) -> str:
        return self.health.name if self.health else ""

    @property
    def roles(self) -> tuple[str, ...]:
        return self.health.roles if self.health else ()

    @property
    def device(self) -> str:
        return self.health.device if self.health else ""

    @property
    def mem_bytes(self) -> int:
        return self.health.mem_bytes if self.health else 0

    @property
    def budget_bytes(self) -> int:
        return self.health.budget_bytes if self.health else 0

    @property
    def tiers(self) -> WeightTiers | None:
        """A prefill node's weights by tier (device, RAM, disk); None: it says none."""
        return self.health.tiers if self.health else None

    @property
    def group(self) -> DecodeGroup | None:
        """A decode node's ranks when it runs as a group (`mlx.launch`); None: one process."""
        return self.health.group if self.health else None

    @property
    def prefill_ranks(self) -> PrefillRanks | None:
        """A prefill node's devices when it runs as ranks (`torchrun`); None: one device."""
        return self.health.prefill_ranks if self.health else None

    @property
    def model(self) -> str:
        return self.health.model_name if self.health else ""

    @property
    def layers(self) -> int:
        return self.health.layers if self.health else 0

    @property
    def layer_kinds(self) -> tuple[ModelLayer, ...]:
        return self.health.layer_kinds if self.health else ()


@dataclass(frozen=True)
class Change:
    severity: Severity
    text: str


@dataclass(frozen=True)
class _Seen:
    """Our own probe's verdict on a node."""

    status: Status
    reason: str | None
    detail: str = ""


@dataclass
class ClusterModel:
    rows: dict[str, NodeRow] = field(default_factory=dict)
    _seen: dict[str, _Seen] = field(default_factory=dict)
    # peer url → reporter url → the reporter's reason for not trusting it (None: trusted)
    _verdicts: dict[str, dict[str, str | None]] = field(default_factory=dict)

    def add(self, url: str) -> bool:
        """Know of a node; True when it is new."""
        url = normalize(url)
        if url in self.rows:
            return False
        self.rows[url] = NodeRow(url)
        return True

    def trusted(self, role: str | None = None) -> list[NodeRow]:
        return [
            r for r in self.rows.values()
            if r.status == "trusted" and (role is None or role in r.roles)
        ]  # fmt: skip

    def update(self, probe: Probe) -> list[Change]:
        """Fold in one probe (and the peers its node reports); what changed, in words."""
        url = probe.url
        self.add(url)
        row = self.rows[url]
        if probe.health is not None:  # an unreachable node keeps what it last said
            row = replace(row, health=probe.health)
        if probe.ok:
            self._seen[url] = _Seen("trusted", None)
        elif probe.reason == "unreachable":
            self._seen[url] = _Seen("unreachable", "unreachable", probe.detail)
        else:
            self._seen[url] = _Seen("rejected", probe.reason, probe.detail)
        changes: list[Change] = []
        touched = [url]
        if probe.cluster is not None:
            me = probe.cluster.me
            if me is not None and me.prefill_tok_s:
                row = replace(row, prefill_tok_s=me.prefill_tok_s)
            self._merge_views(url, probe.cluster, touched)
        self.rows[url] = row
        for u in touched:
            change = self._settle(u)
            if change is not None:
                changes.insert(0 if u == url else len(changes), change)
        return changes

    def _merge_views(self, reporter: str, cluster: Cluster, touched: list[str]) -> None:
        """Peers the node knows become rows; its verdicts and measured rates land on them."""
        for views in self._verdicts.values():
            views.pop(reporter, None)
        for peer in cluster.peers:
            if not peer.address:
                continue
            url = normalize(peer.address)
            if url == reporter:
                continue
            self.add(url)
            self._verdicts.setdefault(url, {})[reporter] = (
                peer.reason if peer.reason in _PEER_REASONS else None
            )
            row = self.rows[url]
            self.rows[url] = replace(
                row,
                prefill_tok_s=peer.prefill_tok_s or row.prefill_tok_s,
                link_Bps=peer.link_Bps or row.link_Bps,
            )
            touched.append(url)

    def _settle(self, url: str) -> Change | None:
        """The row's status from our probe and its trusted peers' verdicts."""
        before = self.rows[url]
        seen = self._seen.get(url)
        if seen is None:
            return None
        status, reason = seen.status, seen.reason
        if status == "trusted":
            for reporter, why in self._verdicts.get(url, {}).items():
                if (
                    why is not None
                    and self._seen.get(reporter, _Seen("connecting", None)).status == "trusted"
                ):
                    status, reason = "rejected", why
        after = replace(before, status=status, reason=reason)
        self.rows[url] = after
        return _transition(before, after, seen.detail)


def _transition(before: NodeRow, after: NodeRow, detail: str) -> Change | None:
    name = after.label
    if before.status == after.status and before.reason == after.reason:
        return None
    if after.status == "trusted":
        if before.status == "unreachable":
            return Change("information", f"{name} is back")
        roles = "+".join(after.roles) or "node"
        return Change("information", f"{name} joined ({roles}, {after.device})")
    if after.status == "unreachable":
        if before.status == "trusted":
            return Change("warning", f"{name} left: {detail or 'not answering'}")
        return Change("warning", f"cannot reach {after.url}: {detail or 'not answering'}")
    why = REASON_TEXT.get(after.reason or "", after.reason or "")
    return Change("error", f"{name} rejected: {why}")
