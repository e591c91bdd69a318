"""The dashboard: Nodes across the top; Pipeline and Bandwidth on the left, Chat on the right.

Workers do the network (probing nodes, following their event streams, mDNS) and only post
messages; handlers fold those into the pure models (`cluster`, `pipeline`, `rates`) and the
widgets redraw. `live=False` builds the same app with no network, to be fed by hand
(snapshots, screenshots).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import ClassVar, TypeVar

import aiohttp
import zeroconf
from tandem.app.tui.browse import browse
from tandem.app.tui.card import below_max, card_text
from tandem.app.tui.client import NodeClient, NodeError, normalize
from tandem.app.tui.cluster import ClusterModel
from tandem.app.tui.messages import NodeFound, NodeProbed, NodeRecord, NodeStreaming
from tandem.app.tui.rates import Bandwidth
from tandem.app.tui.screens.help import HelpScreen
from tandem.app.tui.widgets.bandwidth import BandwidthPanel
from tandem.app.tui.widgets.chat import ChatPanel
from tandem.app.tui.widgets.nodes import NodesTable
from tandem.app.tui.widgets.pipeline import PipelineView
from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header

W = TypeVar("W", bound=Widget)

POLL_S = 2.0  # DESIGN.md: peers are health-checked every 2 s
TICK_S = 0.5
RETRY_S = 1.0


class TandemApp(App[None]):
    """`tandem tui`: watch the cluster and chat with it."""

    CSS_PATH = Path(__file__).with_name("tandem.tcss")  # absolute: subclasses live elsewhere
    TITLE = "tandem"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f1", "help", "Help"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("escape", "cancel_reply", "Cancel reply"),
        Binding("ctrl+r", "refresh_nodes", "Refresh nodes"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(
        self,
        peers: Sequence[str] = (),
        token: str | None = None,
        *,
        mdns: bool = True,
        live: bool = True,
        poll_s: float = POLL_S,
    ) -> None:
        super().__init__()
        self.token = token
        self.mdns = mdns
        self.live = live
        self.poll_s = poll_s
        self.cluster = ClusterModel()
        for url in peers:
            self.cluster.add(url)
        self.bandwidth = Bandwidth.empty()
        self.session: aiohttp.ClientSession | None = None
        self._following: set[str] = set()
        self.streaming: set[str] = set()  # nodes whose event stream is open
        self._poke = asyncio.Event()

    def compose(self) -> ComposeResult:
        yield Header()
        yield NodesTable(id="nodes")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield PipelineView(id="pipeline")
                yield BandwidthPanel(id="bandwidth")
            yield ChatPanel(self.chat_client, self.node_name, id="chat")
        yield Footer()

    def on_mount(self) -> None:
        for panel, title in (
            ("#nodes", "Nodes"), ("#pipeline", "Pipeline"),
            ("#bandwidth", "Bandwidth"), ("#chat", "Chat"),
        ):  # fmt: skip
            self.query_one(panel).border_title = title
        self.show_nodes()
        self.show_bandwidth()
        self.query_one("#prompt").focus()
        if not self.live:
            return
        self.session = aiohttp.ClientSession()
        self.watch_cluster()
        self.set_interval(TICK_S, self.tick)
        if self.mdns:
            self.browse_lan()

    async def on_unmount(self) -> None:
        self.workers.cancel_all()  # before the session they use goes away
        if self.session is not None:
            await self.session.close()

    # ---- workers: network only, results as messages

    @work(exclusive=True, group="cluster")
    async def watch_cluster(self) -> None:
        """Probe every known node every `poll_s` (or at once on Ctrl+R)."""
        assert self.session is not None
        while True:
            urls = list(self.cluster.rows)
            probes = await asyncio.gather(
                *(NodeClient(self.session, url, self.token).probe() for url in urls)
            )
            for probe in probes:
                self.post_message(NodeProbed(probe))
            self._poke.clear()
            with suppress(TimeoutError):  # not wait_for: it can swallow a cancel (3.11)
                async with asyncio.timeout(self.poll_s):
                    await self._poke.wait()

    async def follow_events(self, url: str) -> None:
        """A node's event stream, reconnecting (with `since`) until the app exits."""
        assert self.session is not None
        since: float | None = None
        client = NodeClient(self.session, url, self.token)

        def opened() -> None:
            self.post_message(NodeStreaming(url, True))

        while True:
            with suppress(NodeError):
                async for event in client.events(since, on_open=opened):
                    since = event.t or since
                    self.post_message(NodeRecord(url, event, time.monotonic()))
            self.post_message(NodeStreaming(url, False))
            await asyncio.sleep(RETRY_S)

    @work(exclusive=True, group="mdns")
    async def browse_lan(self) -> None:
        try:
            await browse(lambda url: self.post_message(NodeFound(url)))
        except (OSError, zeroconf.Error) as e:  # no multicast here: --peer still works
            self.notify(f"mDNS discovery is off: {e}", severity="warning")

    # ---- handlers: fold messages into the models, redraw

    def on_node_probed(self, message: NodeProbed) -> None:
        probe = message.probe
        for change in self.cluster.update(probe):
            self.notify(change.text, severity=change.severity, timeout=6)
        if probe.ok and probe.url not in self._following and self.live:
            self._following.add(probe.url)
            self.run_worker(self.follow_events(probe.url), group=f"events {probe.url}")
        self.show_nodes()

    def on_node_found(self, message: NodeFound) -> None:
        if self.cluster.add(message.url):
            self.show_nodes()
            self._poke.set()

    def on_node_streaming(self, message: NodeStreaming) -> None:
        if message.live:
            self.streaming.add(message.url)
        else:
            self.streaming.discard(message.url)

    def on_node_record(self, message: NodeRecord) -> None:
        if (pipeline := self.dashboard(PipelineView)) is not None:
            pipeline.apply(message.record, message.seen)
        self.bandwidth.apply(message.record, message.seen)

    def tick(self) -> None:
        self.bandwidth.roll(time.monotonic())
        self.show_bandwidth()

    # ---- views

    def dashboard(self, cls: type[W]) -> W | None:
        """A dashboard widget, wherever the user is (the help screen may be on top), or None
        before the dashboard is mounted and while the app shuts down."""
        if not self.screen_stack:
            return None
        try:
            return self.screen_stack[0].query_one(cls)
        except NoMatches:
            return None

    def show_nodes(self) -> None:
        rows = list(self.cluster.rows.values())
        table, pipeline = self.dashboard(NodesTable), self.dashboard(PipelineView)
        if table is None or pipeline is None:
            return
        table.show(rows)
        gpus = [r.health.gpu for r in self.cluster.trusted() if r.health and r.health.gpu]
        if (bandwidth := self.dashboard(BandwidthPanel)) is not None:
            bandwidth.show_card(card_text(gpus), any(map(below_max, gpus)))
        pipeline.layers_hint = max((r.layers for r in rows), default=0)
        trusted = self.cluster.trusted()
        # trusted nodes serve one model (fingerprints match): its layers as any of them says
        pipeline.layer_kinds = next((r.layer_kinds for r in trusted if r.layer_kinds), ())
        pipeline.prefill_ranks = tuple(
            (r.id, r.prefill_ranks.size) for r in trusted if r.prefill_ranks is not None
        )
        models = sorted({r.model for r in trusted if r.model})
        self.sub_title = f"{len(trusted)}/{len(rows)} nodes trusted" + (
            f" · {', '.join(models)}" if models else ""
        )

    def show_bandwidth(self) -> None:
        if (panel := self.dashboard(BandwidthPanel)) is not None:
            panel.show(self.bandwidth)

    def node_name(self, url: str) -> str:
        row = self.cluster.rows.get(normalize(url))
        return row.label if row is not None else url

    def chat_client(self) -> NodeClient | None:
        """A client for the first trusted decode node, or None."""
        decoders = self.cluster.trusted("decode")
        if self.session is None or not decoders:
            return None
        return NodeClient(self.session, decoders[0].url, self.token)

    # ---- actions (keys, footer, command palette)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_new_chat(self) -> None:
        if (chat := self.dashboard(ChatPanel)) is not None:
            await chat.new_chat()
            self.notify("New chat: the history is cleared.", timeout=3)

    def action_cancel_reply(self) -> None:
        if (chat := self.dashboard(ChatPanel)) is not None and chat.cancel():
            self.notify("Reply cancelled.", timeout=3)

    def action_refresh_nodes(self) -> None:
        self._poke.set()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "What each panel shows, colours and keys", self.action_help)
        yield SystemCommand("New chat", "Clear the chat history", self.action_new_chat)
        yield SystemCommand("Cancel reply", "Stop the reply in flight", self.action_cancel_reply)
        yield SystemCommand("Refresh nodes", "Probe every node now", self.action_refresh_nodes)
