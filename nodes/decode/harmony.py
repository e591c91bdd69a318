"""gpt-oss's replies in OpenAI's Harmony format, split into an OpenAI chat reply (pure: stdlib
only, no mlx). A reply is a run of messages, their markers the special tokens as the
detokenizer writes them (mlx-lm's keeps special tokens in the text):

    <|channel|>analysis<|message|>thinking<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer<|return|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>

(one line each here). The generation prompt ends in `<|start|>assistant`, so the first header
begins at `<|channel|>` (or at ` to=...`). In a header the recipient `to=NAME` stands after the
role or after the channel's name; `<|constrain|>json` (or a bare `json`) is optional. The
analysis channel goes to `reasoning` (the field mlx-lm's server writes, in messages and
stream deltas), the final channel to `content`, as does a commentary message without a
recipient (a preamble the user is meant to see); a message to `functions.NAME` is a tool call
in OpenAI's shape. A message to any other recipient (a built-in tool no request offers), or
from another role (the model writing a tool's answer itself), is dropped. `<|return|>` and
`<|call|>` are eos tokens, so their text never arrives: a message may end where the text
does. A call cut there counts only where its arguments are a whole JSON object (a reply cut
by max_tokens is not one); a call whose arguments are no JSON object is dropped with a
warning, as mlx-lm's server drops a call it cannot parse. Text before any marker that cannot
begin a header is content: a reply with no markers passes through whole.

One parser for both forms: `HarmonyStream.feed` takes text as it arrives and gives `Delta`s and
`ToolCall`s, holding back only what may be the start of a marker; `parse` feeds it the whole
text at once.

Not `openai-harmony` (PyPI): its encoding loads the o200k_harmony vocabulary from tiktoken
files it downloads at first use (an offline LAN has none; issue openai/harmony#46), its
parser takes token ids of that vocabulary only (a made gpt_oss model has its own small one),
and it adds a native wheel to the decode node. The markers are few and plain: parsed here.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."  # the namespace of the request's tools
_MARKER = re.compile("|".join(map(re.escape, MARKERS)))
_MAY_BE_MARKER = max(map(len, MARKERS)) - 1  # characters held back at most
# what the first header can hold before its <|channel|>: nothing, or the recipient
_HEADER_START = re.compile(r"\s*(?:t|to|to=\S*\s*)?")

Field = Literal["content", "reasoning"]
Mode = Literal["header", "body", "loose"]


@dataclass(frozen=True)
class Delta:
    """Text of the reply's `content` or `reasoning`, as it arrives."""

    field: Field
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A message to `functions.NAME`: the function and its JSON arguments, as written."""

    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape of the call, with an id of its own."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": function}


Event = Delta | ToolCall


@dataclass(frozen=True)
class Function:
    """A message's recipient: the function `name`."""

    name: str


@dataclass(frozen=True)
class HarmonyReply:
    """A whole reply: the final channel's text, the analysis', the calls."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]

    @classmethod
    def of(cls, events: Iterable[Event]) -> HarmonyReply:
        text: dict[Field, list[str]] = {"content": [], "reasoning": []}
        calls = []
        for e in events:
            if isinstance(e, Delta):
                text[e.field].append(e.text)
            else:
                calls.append(e)
        return cls("".join(text["content"]), "".join(text["reasoning"]), tuple(calls))


def speaks_harmony(vocab: Container[str]) -> bool:
    """Whether a tokenizer's vocabulary (token -> id) has the Harmony markers: gpt-oss's."""
    return CHANNEL in vocab and MESSAGE in vocab


def parse(text: str) -> HarmonyReply:
    """The reply `text` makes, whole."""
    stream = HarmonyStream()
    return HarmonyReply.of([*stream.feed(text), *stream.finish()])


class HarmonyStream:
    """A reply's text in, its events out, as the text arrives (`feed`), until `finish`."""

    def __init__(self) -> None:
        self._held = ""  # text that may be the start of a marker
        self._mode: Mode = "header"  # the generation prompt opened the first header
        self._first = True  # in the first header, not yet known to be one
        self._header = ""
        self._to: Field | Function | None = None  # where the open message goes (None: nowhere)
        self._args: list[str] = []  # the open call's arguments

    def feed(self, text: str) -> list[Event]:
        """The events `text` completes."""
        self._held += text
        out: list[Event] = []
        while m := _MARKER.search(self._held):
            self._text(self._held[: m.start()], out)
            self._held = self._held[m.end() :]
            self._marker(m.group(), out)
        keep = _partial_marker(self._held)
        self._text(self._held[: len(self._held) - keep], out)
        self._held = self._held[len(self._held) - keep :]
        return out

    def finish(self) -> list[Event]:
        """The events the end of the text completes: held text, a call cut there."""
        out: list[Event] = []
        self._text(self._held, out)
        self._held = ""
        if self._mode == "header" and self._first and self._header:
            out.append(Delta("content", self._header))  # never a header: plain text
        elif self._mode == "body":
            self._close(out, cut=True)
        self._mode, self._header = "loose", ""
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._mode == "header":
            self._header += text
            if self._first and not _HEADER_START.fullmatch(self._header):
                out.append(Delta("content", self._header))
                self._mode, self._header, self._first = "loose", "", False
        elif self._mode == "loose":
            out.append(Delta("content", text))
        elif isinstance(self._to, Function):
            self._args.append(text)
        elif self._to is not None:
            out.append(Delta(self._to, text))

    def _marker(self, marker: str, out: list[Event]) -> None:
        if marker == CONSTRAIN:
            if self._mode == "header":
                self._header += " "  # `<|constrain|>json`: the content type, a word apart
            return
        self._first = False
        if marker == START or (marker == CHANNEL and self._mode != "header"):
            if self._mode == "body":
                self._close(out)
            self._mode, self._header = "header", ""
        if marker == CHANNEL:
            self._header += CHANNEL
        elif marker == MESSAGE:
            if self._mode == "body":
                self._close(out)
            self._to = _destination(self._header if self._mode == "header" else "")
            self._mode, self._header = "body", ""
        elif marker in (END, RETURN, CALL):
            if self._mode == "body":
                self._close(out)
            self._mode, self._header = "loose", ""

    def _close(self, out: list[Event], cut: bool = False) -> None:
        """End the open message: a call's arguments complete (or `cut` by the text's end)."""
        to, args = self._to, "".join(self._args).strip()
        self._to, self._args = None, []
        if not isinstance(to, Function):
            return
        try:
            ok = isinstance(json.loads(args), dict)
        except ValueError:
            ok = False
        if ok:
            out.append(ToolCall(to.name, args))
        elif cut:
            log.warning("tool call to %s cut off before its arguments were whole; dropped",
                        to.name)  # fmt: skip
        else:
            log.warning("tool call to %s: arguments %r are no JSON object; dropped", to.name,
                        args[:80])  # fmt: skip


def _destination(header: str) -> Field | Function | None:
    """Where a message with this header goes: a field, a function, or nowhere (None).
    The header is `role [to=R]` (empty in the first message), then `<|channel|>` and
    `channel [to=R] [json]`."""
    role_part, _, channel_part = header.partition(CHANNEL)
    role_words, channel_words = role_part.split(), channel_part.split()
    recipients = [w[3:] for w in role_words + channel_words if w.startswith("to=")]
    role = next((w for w in role_words if not w.startswith("to=")), "assistant")
    channel = next((w for w in channel_words if not w.startswith("to=")), "final")
    if role != "assistant":
        log.debug("a message from %s in the reply; dropped", role)
        return None
    if recipients:
        if recipients[0].startswith(FUNCTIONS) and len(recipients[0]) > len(FUNCTIONS):
            return Function(recipients[0][len(FUNCTIONS) :])
        log.warning("a message to %s, no function of the request's; dropped", recipients[0])
        return None
    return "reasoning" if channel == "analysis" else "content"


def _partial_marker(text: str) -> int:
    """How many characters at the end of `text` may be the start of a marker."""
    for n in range(min(len(text), _MAY_BE_MARKER), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in MARKERS):
            return n
    return 0
