"""Messages the dashboard's workers post: small dataclasses, nothing but data."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.app.tui.client import Probe
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.contract.events import Event
from textual.message import Message


@dataclass
class NodeProbed(Message):
    """A fresh look at one node."""

    probe: Probe


@dataclass
class NodeRecord(Message):
    """One event from a node's `/v1/events`, stamped with when it arrived (monotonic)."""

    url: str
    record: Event
    seen: float


@dataclass
class NodeStreaming(Message):
    """A node's event stream opened (`live`) or ended."""

    url: str
    live: bool


@dataclass
class NodeFound(Message):
    """An address learned from mDNS."""

    url: str


@dataclass
class ReplyText(Message):
    """The reply so far. A burst of tokens collapses into the newest of these."""

    reply_id: int
    text: str

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ReplyText) and message.reply_id == self.reply_id


@dataclass
class ReplyDone(Message):
    reply_id: int
    stats: ReplyStats | None


@dataclass
class ReplyFailed(Message):
    reply_id: int
    error: str
    cancelled: bool = False
