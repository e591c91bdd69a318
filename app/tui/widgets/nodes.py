"""The Nodes panel: one row per node, trusted or rejected and why, and its load (a decode
node's batch, a prefill node's queue); a decode group's ranks, or a prefill node's devices
(its ranks), on rows under its node."""

from __future__ import annotations

from rich.text import Text
from tandem.app.tui.card import below_max, link_text
from tandem.app.tui.cluster import NodeRow
from tandem.app.tui.fmt import format_binary, format_link, format_size, format_tok_s
from tandem.nodes.contract.cluster import DecodeGroup, GroupRank, WeightTiers
from tandem.nodes.contract.ranks import PrefillRank, PrefillRanks
from textual.widgets import DataTable

COLUMNS = ("node", "roles", "device", "memory / budget", "model", "status", "prefill", "link")
SHORT_REASON = {  # the notification says it in full
    "unauthorized": "wrong token",
    "model_mismatch": "other model",
    "protocol_mismatch": "other protocol",
    "bad_reply": "bad reply",
}
STATUS_STYLE = {
    "trusted": ("● trusted", "green"),
    "connecting": ("◌ connecting", "dim"),
    "unreachable": ("○ unreachable", "yellow"),
    "rejected": ("✗ rejected", "red"),
}


def status_text(row: NodeRow) -> Text:
    label, style = STATUS_STYLE[row.status]
    if row.status == "rejected" and row.reason:
        label = f"✗ {SHORT_REASON.get(row.reason, row.reason)}"
    text = Text(label, style=style)
    if row.status == "trusted" and (load := load_text(row)):
        text.append(f" · {load}", style="dim")
    return text


def load_text(row: NodeRow) -> str:
    """What a node is doing now, where its `/health` says: a decode node's replies in its
    batch (and waiting), a prefill node's pass in progress (its requests) and its prefills
    queued for the next (their tokens); '' when idle."""
    if row.health is None:
        return ""
    parts = []
    b, q = row.health.batching, row.health.queue
    if b is not None and (b.running or b.waiting):
        waiting = f" +{b.waiting} waiting" if b.waiting else ""
        parts.append(f"batch {b.batch}/{b.running}{waiting}")
    if q is not None and q.running:
        parts.append(f"pass of {q.running}")
    if q is not None and q.waiting:
        parts.append(f"queue {q.waiting} ({format_tokens(q.tokens_waiting)} tok)")
    return " · ".join(parts)


def format_tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def tiers_text(t: WeightTiers) -> str:
    """Where a prefill node's weights are for a warm pass: device, RAM, disk."""
    return f"dev {format_size(t.device)} · RAM {format_size(t.ram)} · disk {format_size(t.disk)}"


def row_cells(row: NodeRow) -> tuple[str | Text, ...]:
    memory = format_size(row.mem_bytes) if row.mem_bytes else "–"
    if row.budget_bytes:
        memory += f" / {format_size(row.budget_bytes)}"
    if row.tiers is not None:
        memory += f" · {tiers_text(row.tiers)}"
    device: str | Text = row.device or "–"
    if row.group is not None:  # its ranks are mlx: the group says more
        device = group_text(row.group)
    if row.prefill_ranks is not None:  # its devices are on the rows under it
        device = devices_text(row.prefill_ranks)
    gpu = row.health.gpu if row.health is not None else None
    if gpu is not None and (link := link_text(gpu)):  # the card's PCIe link, as NVML says
        device = Text(f"{device} · {link}", style="yellow" if below_max(gpu) else "")
    return (
        Text(row.label.removeprefix("http://"), style="bold"),
        "+".join(row.roles) or "–",
        device,
        memory,
        row.model or "–",
        status_text(row),
        format_tok_s(row.prefill_tok_s) if row.prefill_tok_s else "–",
        format_link(row.link_Bps) if row.link_Bps else "–",
    )


def group_text(group: DecodeGroup) -> str:
    return f"group of {group.size} ({group.backend})"


def devices_text(ranks: PrefillRanks) -> str:
    """A prefill node of several devices: how many, on which backend, and whether a rank is
    lost (the node answers 503 and stops)."""
    text = f"{ranks.size} devices" + (f" ({ranks.backend})" if ranks.backend else "")
    return text + (" · rank lost" if ranks.lost else "")


def prefill_rank_cells(rank: PrefillRank) -> tuple[str | Text, ...]:
    """One device of a prefill node, under it: its device, its budget and what it streamed
    in its last pass (its share of every layer)."""
    memory = f"budget {format_size(rank.budget_bytes)}"
    if rank.pass_bytes:
        memory += f" · last pass {format_binary(rank.pass_bytes)}"
    return (Text(f" └ rank {rank.rank}", style="dim"), "", rank.device, memory, "", "", "", "")


def rank_cells(rank: GroupRank) -> tuple[str | Text, ...]:
    """One rank of a group, under its node: where it runs, its layers (first..last), its
    weights and its machine's memory."""
    first, end = rank.layers
    layers = f"layers {first}..{end - 1}" if end > first else "no layers"
    memory = f"weights {format_binary(rank.weight_bytes)}"
    if rank.mem_bytes:
        memory += f" · {format_size(rank.mem_bytes)}"
    name = Text(f" └ rank {rank.rank}", style="dim")
    name.append(f" {rank.host or '?'}")
    return (name, "", layers, memory, "", "", "", "")


class NodesTable(DataTable[str | Text]):
    """Rows keyed by node address; redrawn whole (a cluster is a handful of nodes)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.add_columns(*COLUMNS)

    def show(self, rows: list[NodeRow]) -> None:
        self.clear()
        for row in rows:
            self.add_row(*row_cells(row), key=row.url)
            for rank in row.group.ranks if row.group is not None else ():
                self.add_row(*rank_cells(rank), key=f"{row.url}#rank{rank.rank}")
            ranks = row.prefill_ranks.ranks if row.prefill_ranks is not None else ()
            for device in ranks:
                key = f"{row.url}#prefill-rank{device.rank}"
                self.add_row(*prefill_rank_cells(device), key=key)
        self.border_subtitle = f"{sum(r.status == 'trusted' for r in rows)}/{len(rows)} trusted"
