"""`GET /metrics` (nodes/serve/metrics.py, docs/metrics.md): the collectors on their own, then a
real prefill node and decode node on loopback, read with prometheus_client's own parser after
two chats through the real `openai` client."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tandem.nodes.contract.cluster import Batching, PrefillQueue
from tandem.nodes.contract.events import EventBus, LinkEvent, TokenEvent
from tandem.nodes.serve.metrics import (
    DecodeMetrics,
    HealthCollector,
    NodeMetrics,
    PrefillMetrics,
)
from tandem.nodes.trust.auth import guarded

from tests.conftest import MakeTiny
from tests.nodeproc import NodeProc, remote_pair
from tests.records import stats_of

TOKEN = "test-token-0123456789"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Samples:
    """Every sample of an exposition, by (name, sorted labels), through Prometheus's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`; KeyError if there is none."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    if not found:
        raise KeyError(name)
    return sum(found)


def _registry_text(registry: CollectorRegistry) -> Samples:
    return _samples(generate_latest(registry).decode())


# ------------------------------------------------------------ the collectors alone

GPU = {"pcie_rx_Bps": 1.5e9, "link_gen": 4, "util_pct": 37.0, "temp_c": 61, "bad key": 1,
       "flag": True, "note": "text"}  # fmt: skip


def _health(**fields: object) -> SimpleNamespace:
    """A stand-in for `Health`: the collector reads its fields with getattr, defaults None."""
    return SimpleNamespace(**fields)


def test_health_collector_exports_each_gpu_reading() -> None:
    registry = CollectorRegistry()
    health = _health(gpu=GPU, mlx_memory={"active_bytes": 1 << 30, "peak_bytes": 2 << 30})
    registry.register(HealthCollector(lambda: health, "m"))
    got = _registry_text(registry)
    assert _value(got, "tandem:gpu_pcie_rx_Bps") == 1.5e9
    assert _value(got, "tandem:gpu_link_gen") == 4
    assert _value(got, "tandem:gpu_util_pct") == 37.0
    assert _value(got, "tandem:gpu_temp_c") == 61
    assert _value(got, "tandem:mlx_active_bytes") == 1 << 30
    assert _value(got, "tandem:mlx_peak_bytes") == 2 << 30
    # a key that is no metric name, and values that are no numbers, are left out
    names = {name for name, _ in got}
    assert not {"tandem:gpu_flag", "tandem:gpu_note"} & names
    assert not any(" " in name for name in names)


def test_health_collector_exports_each_ranks_last_pass() -> None:
    """Issue 52: a prefill node of two devices: each rank's share and last pass, by rank."""
    from tandem.nodes.contract.ranks import PrefillRank, PrefillRanks

    ranks = PrefillRanks(2, "nccl", tuple(
        PrefillRank(r, f"cuda:{r}", 22 << 30, None, (), 60 << 30, 0, 40 << 30, 0,
                    pass_bytes=(40 + r) << 30, pass_reduced_bytes=1 << 20, pass_s=2.0 + r)
        for r in range(2)
    ))  # fmt: skip
    registry = CollectorRegistry()
    registry.register(HealthCollector(lambda: _health(prefill_ranks=ranks), "m"))
    got = _registry_text(registry)
    assert _value(got, "tandem:prefill_rank_pass_bytes", rank="1", device="cuda:1") == 41 << 30
    assert _value(got, "tandem:prefill_rank_pass_seconds", rank="0") == 2.0
    assert _value(got, "tandem:prefill_rank_weight_bytes") == 2 * (60 << 30)
    assert _value(got, "tandem:prefill_rank_pass_reduced_bytes", rank="0") == 1 << 20
    assert _value(got, "tandem:prefill_ranks_lost") == 0


def test_health_collector_without_gpu_fields() -> None:
    """A `Health` without the `gpu`/`mlx_memory` fields (before they landed), or with them
    None (another role), exports the role gauges alone."""
    batching = Batching("continuous", running=2, waiting=1, limit=8, batch=2)
    queue = PrefillQueue(waiting=3, tokens_waiting=120)
    for health in (_health(batching=batching, queue=queue),
                   _health(batching=batching, queue=queue, gpu=None, mlx_memory=None)):  # fmt: skip
        registry = CollectorRegistry()
        registry.register(HealthCollector(lambda h=health: h, "m"))
        got = _registry_text(registry)
        assert _value(got, "vllm:num_requests_running", model_name="m") == 2
        assert _value(got, "vllm:num_requests_waiting", model_name="m") == 1
        assert _value(got, "tandem:prefill_queue") == 3
        assert _value(got, "tandem:prefill_queue_tokens") == 120
        assert not any(name.startswith(("tandem:gpu_", "tandem:mlx_")) for name, _ in got)
    registry = CollectorRegistry()
    registry.register(HealthCollector(lambda: _health(), "m"))  # no field at all
    assert _registry_text(registry) == {}


def test_decode_metrics_of_a_reply() -> None:
    registry = CollectorRegistry()
    metrics = DecodeMetrics("m", registry)
    gen = SimpleNamespace(tokens=4, finish_reason="length", token_at=[1.0, 1.25, 1.5, 2.0])
    metrics.finished(10, gen, SimpleNamespace(where="remote", tokens=9, cached=0), 0.3, 1.2)  # type: ignore[arg-type]
    # the whole prompt was in the prompt cache: no prefill to count
    gen = SimpleNamespace(tokens=1, finish_reason="stop", token_at=[3.0])
    metrics.finished(10, gen, SimpleNamespace(where="local", tokens=0, cached=9), 0.1, 0.1)  # type: ignore[arg-type]
    metrics.aborted()
    metrics.failed()
    metrics.batch_size(3)
    got = _registry_text(registry)
    m = {"model_name": "m"}
    assert _value(got, "vllm:prompt_tokens_total", **m) == 20
    assert _value(got, "vllm:generation_tokens_total", **m) == 5
    for reason in ("length", "stop", "abort"):
        assert _value(got, "vllm:request_success_total", finished_reason=reason, **m) == 1
    assert _value(got, "tandem:requests_failed_total") == 1
    assert _value(got, "vllm:time_to_first_token_seconds_count", **m) == 2
    assert _value(got, "vllm:time_to_first_token_seconds_sum", **m) == pytest.approx(0.4)
    # one observation per interval between tokens: 0.25, 0.25, 0.5
    assert _value(got, "vllm:time_per_output_token_seconds_count", **m) == 3
    assert _value(got, "vllm:time_per_output_token_seconds_sum", **m) == pytest.approx(1.0)
    assert _value(got, "vllm:e2e_request_latency_seconds_count", **m) == 2
    assert _value(got, "tandem:prefills_total", where="remote") == 1
    assert _value(got, "tandem:prefills_total", where="local") == 0  # there, at zero
    assert _value(got, "tandem:cached_prompt_tokens_total") == 9
    assert _value(got, "tandem:batch_size_sum") == 3


def test_prefill_metrics_of_a_pass() -> None:
    registry = CollectorRegistry()
    metrics = PrefillMetrics(registry)
    reqs = [SimpleNamespace(tokens=list(range(30))), SimpleNamespace(tokens=list(range(50)))]
    stats = SimpleNamespace(ram_bytes=600, disk_bytes=400, bytes_streamed=1000, h2d_s=0.5)
    metrics.pass_done(reqs, 0.2, [30, 20], stats)  # type: ignore[arg-type]
    got = _registry_text(registry)
    assert _value(got, "tandem:prefill_requests_total") == 2
    assert _value(got, "tandem:prefill_tokens_total") == 50
    assert _value(got, "tandem:prefill_cached_tokens_total") == 30
    assert _value(got, "tandem:weight_bytes_streamed_total", tier="ram") == 600
    assert _value(got, "tandem:weight_bytes_streamed_total", tier="disk") == 400
    assert _value(got, "tandem:prefill_batch_size_sum") == 2
    assert _value(got, "tandem:prefill_pass_seconds_count") == 1
    assert _value(got, "tandem:link_bytes_per_second") == 2000


def test_kv_bytes_come_from_the_bus_at_once() -> None:
    """The bus's listener sees each record as it is published (no task, nothing dropped); a
    node counts the KV frames of its own roles only."""
    bus = EventBus("n")
    metrics = NodeMetrics(lambda: _health(), ("decode",), "m")  # type: ignore[arg-type,return-value]
    bus.listen(metrics.on_event)
    bus.publish(LinkEvent("r", name="net_in", bytes=100, seconds=0.1))
    bus.publish(LinkEvent("r", name="net_out", bytes=7, seconds=0.1))  # no prefill role here
    bus.publish(LinkEvent("r", name="h2d", bytes=5, seconds=0.1))
    bus.publish(TokenEvent("r", count=3))
    got = _samples(metrics.exposition().decode())
    assert _value(got, "tandem:kv_received_bytes_total") == 100
    assert not any(name.startswith("tandem:kv_sent") for name, _ in got)
    assert not any(name.startswith("tandem:prefill_") for name, _ in got)


def test_metrics_is_guarded_and_health_is_not() -> None:
    assert guarded("/metrics") and guarded("/v1/events") and guarded("/v1/chat/completions")
    assert not guarded("/health") and not guarded("/v1/hello") and not guarded("/v1/hello/confirm")


# ------------------------------------------------------------ two real nodes


@pytest.fixture(scope="module")
def pair(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[NodeProc, NodeProc]
]:  # fmt: skip
    model = tiny_model(arch="llama", layers=4, shards=2)
    with remote_pair(tmp_path_factory.mktemp("metrics"), model, "200KB", TOKEN) as nodes:
        yield nodes


def _get(node: NodeProc, path: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, with the bearer token when given."""
    req = urllib.request.Request(node.url + path)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def _chat(client: openai.OpenAI, prompt: str) -> Any:
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
    )


def _scrape(node: NodeProc) -> Samples:
    status, content_type, body = _get(node, "/metrics")
    assert status == 200, body
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    return _samples(body)


def test_two_chats_are_counted_on_both_nodes(pair: tuple[NodeProc, NodeProc]) -> None:
    prefill, decode = pair
    client = openai.OpenAI(base_url=decode.url + "/v1", api_key=TOKEN)
    prompts = ("Why is the sky blue?", "Tell me about lighthouses and the sea.")
    replies = [_chat(client, prompt) for prompt in prompts]
    stats = [stats_of(r) for r in replies]
    assert all(s.prefill == "remote" for s in stats), decode.output()

    got = _scrape(decode)
    m = {"model_name": _model_name(got)}
    assert _value(got, "vllm:request_success_total", **m) == 2
    for r in replies:
        reason = r.choices[0].finish_reason
        assert _value(got, "vllm:request_success_total", finished_reason=reason, **m) >= 1
    assert _value(got, "vllm:prompt_tokens_total", **m) == sum(
        r.usage.prompt_tokens for r in replies
    )
    assert _value(got, "vllm:generation_tokens_total", **m) == sum(
        r.usage.completion_tokens for r in replies
    )
    remote = sum(1 for s in stats if s.prefill_tokens > 0)
    assert remote >= 1
    assert _value(got, "tandem:prefills_total", where="remote") == remote
    assert _value(got, "vllm:time_to_first_token_seconds_count", **m) == 2
    ttft = _value(got, "vllm:time_to_first_token_seconds_sum", **m)
    assert ttft == pytest.approx(sum(s.ttft_s for s in stats), rel=1e-6)
    tokens = sum(r.usage.completion_tokens for r in replies)
    assert _value(got, "vllm:time_per_output_token_seconds_count", **m) == tokens - 2
    assert _value(got, "vllm:e2e_request_latency_seconds_count", **m) == 2
    assert _value(got, "vllm:num_requests_running", **m) == 0
    assert _value(got, "vllm:num_requests_waiting", **m) == 0
    assert _value(got, "tandem:cached_prompt_tokens_total") == sum(s.cached_tokens for s in stats)
    received = _value(got, "tandem:kv_received_bytes_total")
    # the layer frames; a reply's kv_bytes is its whole body (header and done frames too)
    assert 0 < received <= sum(s.kv_bytes for s in stats)
    assert _value(got, "tandem:batch_size_count") >= 1

    got = _scrape(prefill)
    # the decode node's probe of the prefill node is a prefill too
    requests = _value(got, "tandem:prefill_requests_total")
    assert requests >= 2
    assert _value(got, "tandem:prefill_batch_size_sum") == requests
    assert _value(got, "tandem:prefill_pass_seconds_count") >= 1
    assert _value(got, "tandem:prefill_tokens_total") > 0
    assert _value(got, "tandem:kv_sent_bytes_total") >= received
    # 200KB holds less than the model: weights streamed on every pass
    assert _value(got, "tandem:weight_bytes_streamed_total") > 0
    assert _value(got, "tandem:prefill_queue") == 0
    assert not any(name.startswith("vllm:") for name, _ in got)  # no decode role there


def _model_name(samples: Samples) -> str:
    return next(dict(ls)["model_name"] for (n, ls), _ in samples.items() if n.startswith("vllm:"))


def test_metrics_needs_the_token_and_health_does_not(pair: tuple[NodeProc, NodeProc]) -> None:
    for node in pair:
        assert _get(node, "/metrics", token=None)[0] == 401
        assert _get(node, "/metrics", token="wrong-" + TOKEN)[0] == 401
        status, _, body = _get(node, "/health", token=None)
        assert status == 200, body
