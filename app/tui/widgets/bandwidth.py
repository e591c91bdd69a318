"""The Bandwidth panel: a sparkline per link and for decode tokens/s, with now and peak."""

from __future__ import annotations

from tandem.app.tui.fmt import format_gbit, format_rate, format_tok_s
from tandem.app.tui.rates import SERIES, Bandwidth, RateSeries
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

TITLES = {
    "disk": "disk→host",
    "h2d": "host→device",
    "net_out": "net out",
    "net_in": "net in",
    "tokens": "decode",
}
SHOWN = 60  # buckets on screen: 30 s at 0.5 s


def rate_text(name: str, series: RateSeries) -> str:
    """Now (links also in bits) and peak, on two lines; decode in tok/s."""
    if name == "tokens":
        return f"{format_tok_s(series.current)}\npeak {format_tok_s(series.peak)}"
    now = format_rate(series.current)
    if name != "disk":  # links are quoted in bits too
        now += f" · {format_gbit(series.current)}"
    return f"{now}\npeak {format_rate(series.peak)}"


class RateRow(Horizontal):
    """Name, now and peak on the left; the last 30 s as a sparkline on the right."""

    def __init__(self, name: str) -> None:
        super().__init__(id=f"rate-{name}", classes="rate-row")
        self.series_name = name

    def compose(self) -> ComposeResult:
        with Vertical(classes="rate-text"):
            yield Label(TITLES[self.series_name], classes="rate-name")
            yield Static("", classes="rate-value")
            if self.series_name == "h2d":  # the card's own count beside ours, once said
                card = Static("", classes="rate-card")
                card.display = False
                yield card
        yield Sparkline([0.0], classes="rate-spark")

    def show(self, series: RateSeries) -> None:
        spark, value = self.query(Sparkline), self.query("Static.rate-value")
        if not spark or not value:  # not composed yet, or being removed as the app exits
            return
        values = list(series.values)[-SHOWN:]
        spark.first().data = [0.0] * (SHOWN - len(values)) + values
        value.first().update(rate_text(self.series_name, series))


class BandwidthPanel(Vertical):
    def compose(self) -> ComposeResult:
        for name in SERIES:
            yield RateRow(name)

    def show(self, bandwidth: Bandwidth) -> None:
        for row in self.query(RateRow):
            row.show(bandwidth.series[row.series_name])

    def show_card(self, text: str, degraded: bool) -> None:
        """The cards' own PCIe count under host→device (app/tui/card.py); '' hides it."""
        for card in self.query(".rate-card").results(Static):
            card.display = bool(text)
            card.set_class(degraded, "-degraded")
            card.update(text)
