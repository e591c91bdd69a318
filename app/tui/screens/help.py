"""The help screen: what each panel shows, what the colours mean, and the keys."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Markdown

HELP = """\
# tandem dashboard

A GPU node **prefills** (streams the model's layers through a small VRAM budget and turns
the prompt into a KV cache); a Mac node **decodes** from that cache. This screen shows both.

## Nodes
Every node found through `--peer` URLs, mDNS, or another node's peer list: its roles,
device, memory and weight budget, model, and whether it is **trusted** (it proved it holds
the cluster token and serves the same model) or **rejected**, and why. *prefill* is the
rate a decode node measured for that prefill node; *link* is the KV bytes/s it saw.

## Pipeline
One cell per layer of the request in flight:
queued → **loading** (weights copied host→device) → ready → **computing** →
**sent** (its K/V left the prefill node) → **received** (the decode node has it).
A `•` marks a resident layer: it stays on the device between requests. On a model that
mixes layer kinds a cell's letter says its kind: **G** global (K/V of every position),
**S** sliding (K/V of its window only), **L** linear (no K/V: a fixed-size state, the same
bytes for any prompt). *KV per layer* is each layer's frame: its K/V, or a linear layer's
state.

The timeline below is the same request over time: when each layer's weights were
copied, when it computed, and when its K/V was sent. The busiest row bounds the prefill:
*copy-bound* means a faster link (or a bigger budget) helps; *compute-bound* means the GPU.

## Bandwidth
Disk→host, host→device, network out and in (MB/s or GB/s, links also in Gbit/s), and
decode tokens/s: the last 30 seconds, now and peak.

## Chat
Enter sends the prompt to a trusted decode node; the reply streams in as markdown. Under
each reply: where the prefill ran, prompt tokens and prefill rate, time to first token,
and decode rate.

## Keys
| key | does |
| --- | --- |
| `Enter` | send the prompt |
| `Esc` | cancel the reply in flight |
| `Ctrl+N` | new chat (forget the history) |
| `Ctrl+R` | look at every node again now |
| `F1` | this help (`Esc` closes it) |
| `Ctrl+P` | command palette: every action by name |
| `Ctrl+Q` | quit |
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,q", "dismiss", "Close help"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)
        yield Footer()
