"""The Chat panel: prompt, streamed markdown replies, history and per-reply stats.

The reply streams in a worker that only posts messages; Escape cancels that worker, which
closes the connection and so cancels the decode (and a remote prefill) on the nodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tandem.app.tui.client import Delta, NodeClient, NodeError
from tandem.app.tui.fmt import format_seconds, format_tok_s
from tandem.app.tui.messages import ReplyDone, ReplyFailed, ReplyText
from tandem.nodes.contract.bodies import ReplyStats
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Input, Markdown, Static

MAX_TOKENS = 256
# greedy: small models sampled at the API's default temperature (1.0) wander off the question
TEMPERATURE = 0.0
ClientFor = Callable[[], NodeClient | None]
NameOf = Callable[[str], str]  # node address → the name to show


def stats_line(stats: ReplyStats, name_of: NameOf = str) -> str:
    """Where the prefill ran, tokens, time to first token, prefill and decode rates."""
    where = "remote" if stats.prefill == "remote" else "local"
    node = name_of(stats.prefill_node) if stats.prefill_node else ""
    head = f"{where} prefill" + (f" on {node}" if node else "")
    head += f" · KV {stats.kv_dtype}" if stats.kv_dtype else ""
    return (
        f"{head} · {stats.prefill_tokens} prompt tok at {format_tok_s(stats.prefill_tok_s)}"
        f" · TTFT {format_seconds(stats.ttft_s)}"
        f" · {stats.decode_tokens} tok at {format_tok_s(stats.decode_tok_s)}"
    )


class Reply(Vertical):
    """One assistant reply: markdown streamed in, then a stats line."""

    def __init__(self, reply_id: int) -> None:
        super().__init__(id=f"reply-{reply_id}", classes="reply")
        self.reply_id = reply_id
        self.text = ""
        self.first_text_at: float | None = None  # time.monotonic() of the first token shown
        self.stats: ReplyStats | None = None

    def compose(self) -> ComposeResult:
        yield Markdown("", classes="reply-text")
        yield Static("…", classes="reply-stats")

    async def show_text(self, text: str) -> None:
        found = self.query(Markdown)
        if not found:  # being removed as the app exits
            return
        markdown = found.first()
        if not text.startswith(self.text):  # never expected; redraw rather than append
            self.text = ""
            await markdown.update("")
        new, self.text = text[len(self.text) :], text
        if new and self.first_text_at is None:
            self.first_text_at = time.monotonic()
        await markdown.append(new)

    def finish(self, stats: ReplyStats | None, note: str = "", name_of: NameOf = str) -> None:
        self.stats = stats
        line = stats_line(stats, name_of) if stats is not None else ""
        self.set_class(bool(note), "-failed")
        for label in self.query("Static.reply-stats"):  # none while the app exits
            label.update(" · ".join(p for p in (note, line) if p))


class ChatPanel(Vertical):
    """History lives here; `client_for` names the decode node to talk to."""

    busy: reactive[bool] = reactive(False)

    def __init__(
        self, client_for: ClientFor, name_of: NameOf = str, *, id: str | None = None
    ) -> None:
        super().__init__(id=id)
        self.client_for = client_for
        self.name_of = name_of
        self.history: list[dict[str, str]] = []
        self.replies: list[Reply] = []
        self._next_id = 0

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="chat-log")
        yield Input(placeholder="Ask something — Enter sends, Esc cancels", id="prompt")

    def watch_busy(self, busy: bool) -> None:
        self.border_subtitle = "replying… (Esc cancels)" if busy else ""

    @on(Input.Submitted, "#prompt")
    async def submit(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self.busy:
            self.notify("A reply is still streaming: Esc cancels it.", severity="warning")
            return
        client = self.client_for()
        if client is None:
            self.notify("No trusted decode node yet.", severity="error")
            return
        event.input.value = ""
        await self.send(client, prompt)

    async def send(self, client: NodeClient, prompt: str) -> Reply:
        """Show the prompt, start streaming its reply; the reply widget is returned."""
        self._next_id += 1
        reply = Reply(self._next_id)
        self.replies.append(reply)
        self.history.append({"role": "user", "content": prompt})
        log = self.query_one("#chat-log", VerticalScroll)
        await log.mount(Static(prompt, classes="prompt"), reply)
        log.scroll_end(animate=False)
        self.busy = True
        self.stream_reply(client, list(self.history), reply.reply_id)
        return reply

    @work(exclusive=True, group="chat")
    async def stream_reply(
        self, client: NodeClient, messages: list[dict[str, str]], reply_id: int
    ) -> None:
        text = ""
        stats: ReplyStats | None = None
        try:
            async for part in client.chat(messages, MAX_TOKENS, TEMPERATURE):
                if isinstance(part, Delta):
                    text += part.text
                    self.post_message(ReplyText(reply_id, text))
                else:
                    stats = part
        except NodeError as e:
            self.post_message(ReplyFailed(reply_id, str(e)))
            return
        except asyncio.CancelledError:
            self.post_message(ReplyFailed(reply_id, "cancelled", cancelled=True))
            raise
        self.post_message(ReplyDone(reply_id, stats))

    def cancel(self) -> bool:
        """Stop the reply in flight; False when there is none."""
        if not self.busy:
            return False
        self.workers.cancel_group(self, "chat")
        return True

    async def new_chat(self) -> None:
        self.cancel()
        self.history.clear()
        self.replies.clear()
        await self.query_one("#chat-log", VerticalScroll).remove_children()
        self.busy = False
        self.query_one("#prompt", Input).focus()

    def _reply(self, reply_id: int) -> Reply | None:
        return next((r for r in self.replies if r.reply_id == reply_id), None)

    async def on_reply_text(self, message: ReplyText) -> None:
        reply = self._reply(message.reply_id)
        if reply is not None:
            await reply.show_text(message.text)
            for log in self.query("VerticalScroll#chat-log"):
                log.scroll_end(animate=False)

    def on_reply_done(self, message: ReplyDone) -> None:
        reply = self._reply(message.reply_id)
        if reply is None:
            return
        reply.finish(message.stats, name_of=self.name_of)
        self.history.append({"role": "assistant", "content": reply.text})
        self.busy = False

    def on_reply_failed(self, message: ReplyFailed) -> None:
        reply = self._reply(message.reply_id)
        if reply is None:
            return
        reply.finish(None, "cancelled" if message.cancelled else f"failed: {message.error}")
        if reply.text:  # the model sees what the user saw
            self.history.append({"role": "assistant", "content": reply.text})
        elif self.history and self.history[-1]["role"] == "user":
            self.history.pop()
        self.busy = False
        if not message.cancelled:
            self.notify(f"Reply failed: {message.error}", severity="error")
