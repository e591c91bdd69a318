"""A node's Prometheus metrics, `GET /metrics` (docs/metrics.md): every collector and its name.

Each node owns its registry (`NodeMetrics.registry`), never prometheus_client's global one: a
test runs several nodes in one process. Where vLLM exports the same measure, the name and
buckets are vLLM's (`vllm:`); the rest are tandem's (`tandem:`). What feeds them, none of it
on a hot path:

- the node's event bus (`EventBus.listen`): KV bytes as their frames cross, `net_in` on a
  decode node and `net_out` on a prefill node;
- the services, once per reply (`DecodeMetrics.finished`, `aborted`, `failed`), per batch step
  (`DecodeMetrics.batch_size`, from the mlx thread) and per prefill pass
  (`PrefillMetrics.pass_done`);
- the node's `/health` record, read at scrape time (`HealthCollector`): the decode node's
  replies running and waiting, the prefill node's queue, and the `gpu` and `mlx_memory`
  readings where the node has them (each key a gauge).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from tandem.nodes.contract.events import Event, LinkEvent

if TYPE_CHECKING:
    from tandem.nodes.contract.bodies import PrefillBody
    from tandem.nodes.contract.cluster import Health
    from tandem.nodes.contract.ranks import PrefillRanks
    from tandem.nodes.decode.completion import PrefillInfo
    from tandem.nodes.decode.reply import Generation
    from tandem.nodes.prefill.stats import PrefillStats

# the classic text format (Prometheus's `text/plain; version=0.0.4`), which every scraper reads
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py), seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# tandem's: a pass streams every weight once (tens of ms resident, minutes from disk)
PASS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                160.0, 320.0, 640.0)  # fmt: skip
SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # requests in a batch or pass
MODEL = "model_name"  # the label of vLLM's series: the model's name
FINISHED = ("stop", "length", "abort")  # vLLM's `finished_reason`s (its FinishReason)
_M = TypeVar("_M", Counter, Histogram)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # a metric name Prometheus takes

# every metric a node may export but the `/health` readings (`tandem:gpu_*`, `tandem:mlx_*`,
# named by their keys), and its help text; docs/metrics.md says the same for people
HELP = {
    # decode role; vLLM's names, each labelled `model_name`
    "vllm:num_requests_running": "Replies generating now.",
    "vllm:num_requests_waiting": "Replies waiting for a generation slot.",
    "vllm:prompt_tokens": "Prompt tokens of finished replies.",
    "vllm:generation_tokens": "Tokens of finished replies.",
    "vllm:request_success": "Replies ended: stop, length, or abort (the client left).",
    "vllm:time_to_first_token_seconds": "Time to first token, from the reply's slot (seconds).",
    "vllm:time_per_output_token_seconds": "Each interval between a reply's tokens (seconds).",
    "vllm:e2e_request_latency_seconds": "A reply's latency, from its slot to its last token.",
    # decode role; tandem's
    "tandem:requests_failed": "Replies whose generation failed (a 500, or a 503).",
    "tandem:prefills": "Prompt prefills by where they ran (a prompt cached whole needs none).",
    "tandem:cached_prompt_tokens": "Prompt positions taken from the prompt cache.",
    "tandem:kv_received_bytes": "KV frame bytes received from prefill nodes.",
    "tandem:batch_size": "Replies stepped together in one step of the decode batch.",
    # prefill role
    "tandem:prefill_ranks_lost": "1 where a rank of this prefill node is lost (it is stopping).",
    "tandem:prefill_rank_weight_bytes": "Each rank's share of every layer's weights (bytes).",
    "tandem:prefill_rank_pass_bytes": "Weight bytes each rank streamed in the last pass.",
    "tandem:prefill_rank_pass_reduced_bytes": "Each rank's all-reduce bytes in the last pass.",
    "tandem:prefill_rank_pass_seconds": "Each rank's last pass (seconds).",
    "tandem:prefill_requests": "Prefill requests a pass ran.",
    "tandem:prefill_tokens": "Prompt positions computed (not taken from the prefix cache).",
    "tandem:prefill_cached_tokens": "Prompt positions taken from the prefix cache.",
    "tandem:kv_sent_bytes": "KV frame bytes sent to decode nodes.",
    "tandem:weight_bytes_streamed": "Weight bytes streamed to the device, by where they came "
    "from (ram: the RAM tier; disk: read from disk).",
    "tandem:prefill_pass_seconds": "Seconds one pass of the weights took.",
    "tandem:prefill_batch_size": "Requests in one pass.",
    "tandem:link_bytes_per_second": "The last pass's host-to-device copy rate (bytes/s).",
    "tandem:prefill_queue": "Prefills waiting for a pass.",
    "tandem:prefill_queue_tokens": "Prompt tokens of the prefills waiting for a pass.",
}


class DecodeMetrics:
    """A decode node's replies: vLLM's request metrics, and where their prompts were
    prefilled. `model_name` labels the `vllm:` ones, as vLLM's own do."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        r = CollectorRegistry() if registry is None else registry  # None: one of its own

        def vllm(metric: _M) -> _M:  # this node's model's series, there from the start
            return metric.labels(model_name)

        self.prompt_tokens = vllm(_counter(r, "vllm:prompt_tokens", MODEL))
        self.generation_tokens = vllm(_counter(r, "vllm:generation_tokens", MODEL))
        self.ttft = vllm(_histogram(r, "vllm:time_to_first_token_seconds", TTFT_BUCKETS, MODEL))
        self.tpot = vllm(_histogram(r, "vllm:time_per_output_token_seconds", TPOT_BUCKETS, MODEL))
        self.e2e = vllm(_histogram(r, "vllm:e2e_request_latency_seconds", LATENCY_BUCKETS, MODEL))
        self._model_name = model_name
        self._success = _counter(r, "vllm:request_success", MODEL, "finished_reason")
        for why in FINISHED:
            self._success.labels(model_name, why)
        self._failed = _counter(r, "tandem:requests_failed")
        self.prefills = _counter(r, "tandem:prefills", "where")
        for where in ("remote", "local"):
            self.prefills.labels(where)
        self.cached_tokens = _counter(r, "tandem:cached_prompt_tokens")
        self.kv_received = _counter(r, "tandem:kv_received_bytes")
        self._batch_size = _histogram(r, "tandem:batch_size", SIZE_BUCKETS)

    def batch_size(self, size: int) -> None:
        """One batch step of `size` replies (on the mlx thread)."""
        self._batch_size.observe(size)

    def finished(
        self, prompt_tokens: int, gen: Generation, prefill: PrefillInfo, ttft_s: float, e2e_s: float
    ) -> None:
        """A reply that ended with its last token (eos, a stop string or its limit)."""
        self._success.labels(self._model_name, gen.finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(gen.tokens)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        for before, after in itertools.pairwise(gen.token_at):
            self.tpot.observe(after - before)
        if prefill.tokens > 0:
            self.prefills.labels(prefill.where).inc()
        self.cached_tokens.inc(prefill.cached)

    def aborted(self) -> None:
        """A reply whose client went away."""
        self._success.labels(self._model_name, "abort").inc()

    def failed(self) -> None:
        """A reply whose generation failed."""
        self._failed.inc()


class PrefillMetrics:
    """A prefill node's passes: requests, tokens, weight bytes streamed, KV bytes sent."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = CollectorRegistry() if registry is None else registry  # None: one of its own
        self.requests = _counter(r, "tandem:prefill_requests")
        self.tokens = _counter(r, "tandem:prefill_tokens")
        self.cached_tokens = _counter(r, "tandem:prefill_cached_tokens")
        self.kv_sent = _counter(r, "tandem:kv_sent_bytes")
        self.weight_bytes = _counter(r, "tandem:weight_bytes_streamed", "tier")
        for tier in ("ram", "disk"):
            self.weight_bytes.labels(tier)
        self.pass_seconds = _histogram(r, "tandem:prefill_pass_seconds", PASS_BUCKETS)
        self.batch_size = _histogram(r, "tandem:prefill_batch_size", SIZE_BUCKETS)
        rate = "tandem:link_bytes_per_second"
        self.link_rate = Gauge(rate, HELP[rate], registry=r)

    def pass_done(
        self,
        reqs: Sequence[PrefillBody],
        seconds: float,
        computed: Sequence[int],
        stats: PrefillStats,
    ) -> None:
        """One pass that ran: its requests, its seconds, the positions each computed, and
        the engine's stats of it (the streamer's bytes are the pass's)."""
        self.requests.inc(len(reqs))
        self.batch_size.observe(len(reqs))
        self.pass_seconds.observe(seconds)
        self.tokens.inc(sum(computed))
        self.cached_tokens.inc(sum(len(r.tokens) for r in reqs) - sum(computed))
        self.weight_bytes.labels("ram").inc(stats.ram_bytes)
        self.weight_bytes.labels("disk").inc(stats.disk_bytes)
        if stats.h2d_s > 0:
            self.link_rate.set(stats.bytes_streamed / stats.h2d_s)


class HealthCollector(Collector):
    """Gauges read from the node's `/health` record at each scrape. Each field may be absent
    (an older record) or None (not this node's role, or not measured here)."""

    def __init__(self, health: Callable[[], Health], model_name: str) -> None:
        self.health, self.model_name = health, model_name

    def describe(self) -> list[Metric]:
        return []  # names differ by node: nothing is read before the first scrape

    def collect(self) -> Iterator[Metric]:
        health = self.health()
        batching = getattr(health, "batching", None)
        if batching is not None:
            yield _gauge("vllm:num_requests_running", batching.running, self.model_name)
            yield _gauge("vllm:num_requests_waiting", batching.waiting, self.model_name)
        queue = getattr(health, "queue", None)
        if queue is not None:
            yield _gauge("tandem:prefill_queue", queue.waiting)
            yield _gauge("tandem:prefill_queue_tokens", queue.tokens_waiting)
        ranks = getattr(health, "prefill_ranks", None)
        if ranks is not None:  # a prefill node of several devices: each rank's last pass
            yield from _rank_gauges(ranks)
        for field, prefix in (("gpu", "tandem:gpu_"), ("mlx_memory", "tandem:mlx_")):
            readings = getattr(health, field, None)
            if not isinstance(readings, dict):
                continue
            for key, value in readings.items():
                name = prefix + str(key)
                if _NAME.fullmatch(name) and _number(value):
                    yield GaugeMetricFamily(name, f"/health {field}.{key}", value=value)


RANK_GAUGES = {  # `/health` prefill_ranks' per-rank fields, labelled `rank` and `device`
    "tandem:prefill_rank_weight_bytes": "weight_bytes",
    "tandem:prefill_rank_pass_bytes": "pass_bytes",
    "tandem:prefill_rank_pass_reduced_bytes": "pass_reduced_bytes",
    "tandem:prefill_rank_pass_seconds": "pass_s",
}


def _rank_gauges(ranks: PrefillRanks) -> Iterator[Metric]:
    yield _gauge("tandem:prefill_ranks_lost", float(bool(ranks.lost)))
    for name, field in RANK_GAUGES.items():
        family = GaugeMetricFamily(name, HELP[name], labels=["rank", "device"])
        for r in ranks.ranks:
            family.add_metric([str(r.rank), r.device], float(getattr(r, field)))
        yield family


def _counter(registry: CollectorRegistry, name: str, *labels: str) -> Counter:
    return Counter(name, HELP[name], labels, registry=registry)


def _histogram(
    registry: CollectorRegistry, name: str, buckets: Sequence[float], *labels: str
) -> Histogram:
    return Histogram(name, HELP[name], labels, registry=registry, buckets=buckets)


def _gauge(name: str, value: float, model_name: str | None = None) -> Metric:
    """One of the `/health` role gauges, labelled with the model as vLLM's are."""
    if model_name is None:
        return GaugeMetricFamily(name, HELP[name], value=value)
    family = GaugeMetricFamily(name, HELP[name], labels=[MODEL])
    family.add_metric([model_name], value)
    return family


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class NodeMetrics:
    """One node's registry and what feeds it: the metrics of its roles, and its `/health`."""

    def __init__(self, health: Callable[[], Health], roles: Sequence[str], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(HealthCollector(health, model_name))
        self.decode = DecodeMetrics(model_name, self.registry) if "decode" in roles else None
        self.prefill = PrefillMetrics(self.registry) if "prefill" in roles else None

    def on_event(self, event: Event) -> None:
        """The node's event bus listener (any thread): KV frames as they cross."""
        if not isinstance(event, LinkEvent):
            return
        if event.name == "net_in" and self.decode is not None:
            self.decode.kv_received.inc(event.bytes)
        elif event.name == "net_out" and self.prefill is not None:
            self.prefill.kv_sent.inc(event.bytes)

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
