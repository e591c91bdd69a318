"""The Pipeline panel: one cell per layer of the request in flight, coloured by state (on a
model that mixes layer kinds, lettered G global, S sliding window or L linear), the bytes each
layer's frame carried (K/V, or a linear layer's state), and the timeline of that request as
three busy strips (copy, compute, send) — from a prefill node of several devices, a copy and a
compute strip per device (rank), then the send; under its headline, a line for each other
request in flight (its layers sent, its tokens so far: several at once batch on the decode
node).

The widget owns a `PipelineModel`; tests read `view.model` rather than pixels.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text
from tandem.app.tui.fmt import format_seconds
from tandem.app.tui.pipeline import PIPE_STATES, PipelineModel, RequestTrack, Span, Timeline
from tandem.nodes.contract.cluster import ModelLayer
from tandem.nodes.contract.units import format_bytes
from textual.app import RenderResult
from textual.reactive import reactive
from textual.widget import Widget

# state → (background, foreground); copy/compute/send strips reuse loading/computing/sent
STATE_STYLE = {
    "queued": ("grey35", "white"),
    "loading": ("dark_orange", "black"),
    "ready": ("gold3", "black"),
    "computing": ("medium_purple", "black"),
    "sent": ("dodger_blue2", "white"),
    "received": ("green3", "black"),
}
ROW_STYLE = {
    "copy": ("dark_orange", "orange4"),
    "compute": ("medium_purple", "purple4"),
    "send": ("dodger_blue2", "navy_blue"),
}
CELL = 4  # columns per layer cell (5 with a kind letter), plus one space between cells
# a layer's kind (`/health` layer_kinds) → its letter: global (full attention), sliding
# window, linear (a Gated DeltaNet: a fixed-size state instead of K/V), latent (multi-head
# latent attention: a latent and a rope key a position); and the legend's words
KIND_MARK = {"full": "G", "sliding": "S", "linear": "L", "latent": "M"}
KIND_NAME = {"full": "global", "sliding": "sliding window", "linear": "linear (state)",
             "latent": "latent (MLA)"}  # fmt: skip
LABEL = 9  # columns before the timeline strips (a rank's lane takes more: "compute 1 ")
BUSY = 9  # columns after them: the row's busy time


class PipelineView(Widget):
    """Live layer states; redrawn when a record changes the picture."""

    request_id: reactive[str] = reactive("")
    layers_hint: reactive[int] = reactive(0)  # a node's layer count, before any request
    layer_kinds: reactive[tuple[ModelLayer, ...]] = reactive(())  # the model's, from /health
    # (node id, its ranks) of each prefill node of several devices, from /health
    prefill_ranks: reactive[tuple[tuple[str, int], ...]] = reactive(())

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model = PipelineModel()

    def apply(self, record: dict[str, Any], seen: float | None = None) -> None:
        if self.model.apply(record, seen):
            self.request_id = self.model.current_id or ""
            self.refresh(layout=True)

    def watch_request_id(self, request_id: str) -> None:
        self.border_subtitle = f"request {request_id}" if request_id else ""

    def render(self) -> RenderResult:
        width = max(20, self.size.width or 80)
        req = self.model.current
        if req is None:
            hint = f"{self.layers_hint} layers ready. " if self.layers_hint else "No nodes yet. "
            return Text(
                hint + "Send a prompt in Chat (or from any OpenAI client) and watch each "
                "layer's weights stream in, compute, and travel to the decode node.",
                style="dim",
            )
        parts: list[RenderableType] = [_headline(req), *_others(self.model)]
        if req.where == "local" and not req.layers:
            parts.append(Text("prefill ran on the decode node (mlx): no layers streamed", "dim"))
        else:
            kinds = self.layer_kinds if _lettered(self.layer_kinds) else ()
            parts += [*_cells(req, width, kinds), _legend(kinds)]
            if (kv := _kv_line(req, kinds)) is not None:
                parts.append(kv)
            if (experts := _experts_line(req)) is not None:
                parts.append(experts)
        timeline = req.timeline(dict(self.prefill_ranks).get(req.prefill_node, 1))
        if timeline is not None:
            parts += _strips(timeline, width)
        return Group(*parts)


def _headline(req: RequestTrack) -> Text:
    where = {"remote": "remote prefill", "local": "local prefill"}.get(req.where, "prefill")
    text = Text(where, style="bold")
    if req.kv_dtype:
        text.append(f" · KV {req.kv_dtype}", style="dim")
    if req.phase:
        text.append(f" · {req.phase.replace('_', ' ')}", style="dim")
    if req.layers:
        text.append(f" · {req.layers_sent}/{req.n_layers} layers sent", style="dim")
    return text


MAX_OTHERS = 4  # lines for the other requests in flight; the rest counted


def _others(model: PipelineModel) -> list[Text]:
    """A line per other request in flight: its prefill's layers sent, its tokens so far."""
    others = model.others_in_flight()
    lines = []
    for req in others[:MAX_OTHERS]:
        text = Text("  ▸ ", style="bold").append(req.request_id[-12:], style="bold")
        text.append(f" · {req.where or 'queued'}", style="dim")
        if req.layers:
            text.append(f" · {req.layers_sent}/{req.n_layers} layers", style="dim")
        if req.tokens:
            text.append(f" · {req.tokens} tokens", style="dim")
        lines.append(text.append(f" · {req.phase.replace('_', ' ')}", style="dim"))
    if len(others) > MAX_OTHERS:
        lines.append(Text(f"  and {len(others) - MAX_OTHERS} more in flight", style="dim"))
    return lines


def _lettered(kinds: tuple[ModelLayer, ...]) -> bool:
    """Whether cells carry their kind: only where the model mixes kinds."""
    return any(k.kind != "full" for k in kinds)


def _cells(req: RequestTrack, width: int, kinds: tuple[ModelLayer, ...]) -> list[Text]:
    per_line = max(1, (width + 1) // (CELL + bool(kinds) + 1))
    lines: list[Text] = []
    line = Text()
    for i in range(req.n_layers):
        layer = req.layers.get(i)
        state = layer.state if layer else "queued"
        bg, fg = STATE_STYLE[state]
        mark = "•" if layer is not None and layer.pinned else " "
        if i and i % per_line == 0:
            lines.append(line)
            line = Text()
        elif i:
            line.append(" ")
        letter = KIND_MARK.get(kinds[i].kind, "?") if i < len(kinds) else ""
        line.append(f"{i:>3}{letter}{mark}", style=f"{fg} on {bg}")
    lines.append(line)
    return lines


def _legend(kinds: tuple[ModelLayer, ...]) -> Text:
    text = Text()
    for state in PIPE_STATES:
        bg, _ = STATE_STYLE[state]
        text.append("■", style=bg).append(f"{state} ")
    text.append("• resident", style="bold")
    present = {k.kind for k in kinds}
    for kind, mark in KIND_MARK.items():  # only the kinds this model has
        if kind in present:
            text.append(f"  {mark} {KIND_NAME[kind]}", style="bold")
    return text


def _kv_line(req: RequestTrack, kinds: tuple[ModelLayer, ...]) -> Text | None:
    """The bytes per layer sent so far: per kind where the model mixes them (a sliding
    layer's stop growing at its window, a linear layer's state is the same for any prompt),
    else one figure; None before any was sent."""
    sent = {i: t.kv_bytes for i, t in req.layers.items() if t.kv_bytes}
    if not sent:
        return None
    groups: dict[str, list[int]] = {}
    windows: dict[str, set[int]] = {}
    for i, nbytes in sorted(sent.items()):
        kind = kinds[i] if i < len(kinds) else ModelLayer()
        groups.setdefault(KIND_MARK.get(kind.kind, "?") if kinds else "", []).append(nbytes)
        if kind.window is not None:
            windows.setdefault(KIND_MARK["sliding"], set()).add(kind.window)
    text = Text("KV per layer", style="bold")
    order = [*KIND_MARK.values(), "?", ""]  # global layers first
    for mark, sizes in sorted(groups.items(), key=lambda kv: order.index(kv[0])):
        lo, hi = min(sizes), max(sizes)
        size = format_bytes(hi) if lo == hi else f"{format_bytes(lo)}–{format_bytes(hi)}"
        text.append(f"  {mark} " if mark else "  ", style="bold").append(f"{size} ×{len(sizes)}")
        if mark in windows:
            text.append(f" (window {'/'.join(map(str, sorted(windows[mark])))})", style="dim")
        elif mark == KIND_MARK["linear"]:
            text.append(" (state, fixed)", style="dim")
    return text.append(f"  · {format_bytes(sum(sent.values()))} in all", style="dim")


def _experts_line(req: RequestTrack) -> Text | None:
    """A mixture of experts: per routed layer, the experts its router chose (the only ones
    streamed) out of all; None for a model without experts."""
    routed = {i: t.experts for i, t in sorted(req.layers.items()) if t.experts is not None}
    if not routed:
        return None
    text = Text("experts read", style="bold")
    for i, (read, total) in routed.items():
        text.append(f"  {i}:", style="dim").append(f"{read}/{total}")
    read = sum(r for r, _ in routed.values())
    total = sum(t for _, t in routed.values())
    text.append(f"  · {read} of {total} in all", style="dim")
    if nbytes := sum(t.experts_bytes for t in req.layers.values()):
        text.append(f", {format_bytes(nbytes)} streamed", style="dim")
    return text


def _strips(tl: Timeline, width: int) -> list[Text]:
    head = Text("timeline", style="bold").append(f" {format_seconds(tl.wall)}")
    if tl.bound:
        head.append(f" → {tl.bound}-bound", style="bold")
    label_w = max(LABEL, *(len(lane) + 1 for lane in tl.rows))
    n = max(8, width - label_w - BUSY)
    return [head, *(_strip(lane, spans, tl, n, label_w) for lane, spans in tl.rows.items())]


def _strip(lane: str, spans: list[Span], tl: Timeline, n: int, label_w: int) -> Text:
    """One lane of the Gantt strip (copy, compute or send; a rank's copy or compute): each
    span in its layer's shade, labelled where it fits, then the lane's busy time."""
    owner: list[int | None] = [None] * n
    starts: dict[int, int] = {}
    scale = n / tl.wall if tl.wall > 0 else 0.0
    for layer, a, b in spans:
        c0 = min(n - 1, int((a - tl.t0) * scale))
        c1 = max(c0 + 1, min(n, math.ceil((b - tl.t0) * scale)))
        for c in range(c0, c1):
            owner[c] = layer
        starts.setdefault(layer, c0)
    text = Text(f"{lane:<{label_w}}", style="bold")
    shades = ROW_STYLE[lane.split()[0]]
    c = 0
    while c < n:
        layer = owner[c]
        end = c
        while end < n and owner[end] == layer:
            end += 1
        if layer is None:
            text.append("·" * (end - c), style="grey30")
        else:
            label = str(layer) if starts.get(layer) == c and len(str(layer)) <= end - c else ""
            style = f"{('black', 'white')[layer % 2]} on {shades[layer % 2]}"
            text.append(label.ljust(end - c), style=style)
        c = end
    return text.append(f"{format_seconds(tl.busy[lane]):>{BUSY}}")
