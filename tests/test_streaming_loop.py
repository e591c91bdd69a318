"""The streaming loop's mechanics that a CPU can show (issue 17): cut layers streamed in equal
loads, the activation reserve and its 413, slots released as soon as compute is queued, and a
cut op's slices added into the residual once. Host memory and reads:
test_streaming_loop_host.py."""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.events import Event, LayerEvent
from tandem.nodes.model import fingerprint
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.errors import PromptTooLong
from tandem.nodes.prefill.kernels.blocks import LayerState, out_rows_part
from tandem.nodes.prefill.planning.budget import prompt_activations
from tandem.nodes.prefill.planning.plan import RING_LOADS, make_plan

from tests.conftest import MakeTiny
from tests.nodeproc import start_node
from tests.records import listen


def model_bytes(index: ModelIndex) -> int:
    return sum(index.layer_bytes(i) for i in range(index.spec.num_layers))


@pytest.fixture
def index(tiny_model: MakeTiny) -> ModelIndex:
    return load_index(tiny_model(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=768))


# ---------------------------------------------------------------- the plan


def test_a_cut_layer_streams_in_equal_loads_with_several_in_flight(index: ModelIndex) -> None:
    """Where a layer must be cut, no copy waits behind a load much bigger than the others:
    loads of at most a RING_LOADS-th of the ring, and at least RING_LOADS slots."""
    budget = index.layer_bytes(0)  # half of it is the ring: half a layer
    plan = make_plan(index, budget, direct=True)
    assert plan.granularity == "slice"
    assert plan.n_slots >= RING_LOADS
    streamed = [ld.weight_bytes for ld in plan.loads if not ld.resident]
    assert max(streamed) <= 2 * statistics.median(streamed)
    assert plan.device_bytes <= budget


def test_the_activation_reserve_comes_out_of_the_weights(index: ModelIndex) -> None:
    budget = model_bytes(index) // 2
    plain = make_plan(index, budget, direct=True)
    reserve = budget // 4
    kept = make_plan(index, budget, direct=True, reserve=reserve)
    assert kept.reserve_bytes == reserve
    assert kept.device_bytes + reserve <= budget < plain.device_bytes + reserve
    with pytest.raises(ModelError, match="leaves nothing for weights"):
        make_plan(index, budget, reserve=budget)


def test_attention_takes_all_queries_at_once_only_where_a_fused_kernel_runs(
    index: ModelIndex,
) -> None:
    """On CUDA, half precision with a head of at most 256 goes through flash attention whole;
    an fp32 model (or a head of 512) would fall to SDPA's MATH kernel and hold the whole
    [heads, T, S] score matrix, so it is chunked as on a CPU, and reserved for what that
    kernel holds (float32 scores, K/V repeated to every head), plus CUDA's own slack and the
    K/V in flight to the host."""
    from tandem.nodes.prefill.kernels.blocks import fused_attention
    from tandem.nodes.prefill.planning.activations import CUDA_SLACK, math_attention_bytes

    assert fused_attention("cuda", 2, 128) and fused_attention("cuda", 2, 256)
    assert not fused_attention("cuda", 4, 128)  # float32: no flash kernel
    assert not fused_attention("cuda", 2, 512) and not fused_attention("cpu", 2, 128)
    spec, tokens = index.spec, 4096  # a float32 model
    cpu = prompt_activations(spec, tokens, 0, 512, 4, "cpu", cut_ops=False)
    cuda = prompt_activations(spec, tokens, 0, 512, 4, "cuda", cut_ops=False)
    in_flight = 2 * spec.num_kv_heads * tokens * spec.head_dim * 4  # the previous layer's K/V
    assert cuda > int((cpu + in_flight) * CUDA_SLACK[0]) + CUDA_SLACK[1]
    math = math_attention_bytes(spec.num_heads, spec.num_kv_heads, 512, tokens, spec.head_dim, 4)
    assert cuda >= (cpu + in_flight + math - 2 * spec.num_heads * 512 * tokens * 4) * CUDA_SLACK[0]


def test_the_reserve_holds_a_cut_ops_output_only_where_the_plan_cuts_one(
    index: ModelIndex,
) -> None:
    """Whole ops keep no output across parts: a plan that cuts none does not reserve room
    for one ([tokens, intermediate], 470 MiB at 8k tokens for a 70B model); one that cuts an
    op does, and takes prompts up to the same length as the whole-op plan."""
    spec, tokens = index.spec, 64
    whole = prompt_activations(spec, tokens, 0, 32, 4, "cpu", cut_ops=False)
    cut = prompt_activations(spec, tokens, 0, 32, 4, "cpu", cut_ops=True)
    assert cut - whole == tokens * max(spec.num_heads * spec.head_dim, spec.intermediate_size) * 4
    for budget, cuts in ((2 * model_bytes(index), False), (model_bytes(index) // 6, True)):
        engine = PrefillEngine(
            index, budget=budget, device="cpu", max_prompt_tokens=tokens, chunk_tokens=32
        )
        try:
            assert engine.plan.cuts_ops is cuts
            assert (
                engine.activation_reserve == engine.plan.reserve_bytes == (cut if cuts else whole)
            )
            assert len(list(engine.prefill(list(range(tokens))))) == spec.num_layers
            with pytest.raises(PromptTooLong):
                engine.check_fits(tokens + 1)
        finally:
            engine.close()


def test_a_prompt_beyond_the_reserve_is_refused_before_streaming(index: ModelIndex) -> None:
    events: list[Event] = []
    engine = PrefillEngine(
        index, budget=model_bytes(index) // 2, device="cpu", max_prompt_tokens=64,
        chunk_tokens=32,
    )  # fmt: skip
    listen(engine.events, events.append)
    try:
        assert engine.plan.reserve_bytes == engine.activation_reserve > 0
        assert engine.plan.device_bytes + engine.activation_reserve <= engine.budget
        with pytest.raises(PromptTooLong, match="64 tokens"):
            next(engine.prefill(list(range(65))))
        assert not [e for e in events if isinstance(e, LayerEvent)]  # nothing streamed
        assert len(list(engine.prefill(list(range(64))))) == index.spec.num_layers
    finally:
        engine.close()


def test_prefill_node_answers_a_too_long_prompt_with_413(
    tiny_model: MakeTiny, tmp_path: Path
) -> None:
    model = tiny_model(layers=2)
    node = start_node(tmp_path, model, "prefill", "--device", "cpu", "--max-prompt-tokens", "32")
    try:
        fp = fingerprint(load_index(model))

        def post(n: int) -> tuple[int, bytes]:
            body = PrefillBody(fp, f"long-{n}", list(range(1, n + 1)))
            req = urllib.request.Request(
                node.url + "/v1/prefill", method="POST", data=json.dumps(body.to_json()).encode(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        status, raw = post(40)
        assert status == 413
        error = json.loads(raw)["error"]
        assert error["code"] == "prompt_too_long" and "32 tokens" in error["message"]
        status, _ = post(30)
        assert status == 200  # and the node still serves
    finally:
        node.stop()


# ---------------------------------------------------------------- the ring


def test_a_slot_is_released_as_soon_as_its_compute_is_queued(index: ModelIndex) -> None:
    """While the consumer holds a finished layer (a network send, say), the loader already
    refills the slot that layer's compute used: the ring does not wait on the consumer."""
    engine = PrefillEngine(index, budget=model_bytes(index) // 3, device="cpu")
    stamps: list[tuple[float, LayerEvent]] = []
    listen(
        engine.events,
        lambda e: stamps.append((time.perf_counter(), e)) if isinstance(e, LayerEvent) else None,
    )
    plan = engine.plan
    streamed = [ld for ld in plan.loads if not ld.resident]
    assert plan.n_slots >= 2 and len(streamed) > plan.n_slots
    holds: list[tuple[int, float, float]] = []
    try:
        for kv in engine.prefill(list(range(40))):
            t0 = time.perf_counter()
            time.sleep(0.05)  # the consumer is busy with layer kv.layer
            holds.append((kv.layer, t0, time.perf_counter()))
    finally:
        engine.close()
    refilled = 0
    for layer, t0, t1 in holds:
        last = max(ld.seq for ld in plan.loads if ld.layer == layer)
        reuse = [ld for ld in streamed if ld.seq > last][: plan.n_slots]
        reuse = [ld for ld in reuse if engine.streamer.slot_of(ld) == _slot_of_layer(engine, layer)]
        if not reuse:
            continue
        started = [t for t, e in stamps if e.state == "loading" and e.layer == reuse[0].layer]
        refilled += bool(started) and t0 <= started[0] < t1
    assert refilled >= 1


def _slot_of_layer(engine: PrefillEngine, layer: int) -> int | None:
    loads = [ld for ld in engine.plan.loads if ld.layer == layer]
    return engine.streamer.slot_of(loads[-1])


# ---------------------------------------------------------------- the residual


def test_a_cut_op_adds_each_residual_value_once() -> None:
    """bf16: o_proj (or down_proj) cut into row ranges adds each residual column once, the
    whole sum over the kept output: h + bf16(x @ W.T), one rounding, as an uncut op. Small
    integers make every product and partial sum exact, so no BLAS blocking moves a bit."""
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    kept = torch.randint(-3, 4, (64, 96), generator=g).to(torch.bfloat16)
    weight = torch.randint(-3, 4, (48, 96), generator=g).to(torch.bfloat16) * 2**-7
    h = h0.clone()
    state = LayerState(torch.empty(0), torch.empty(0), out=kept)
    bounds = [0, 10, 11, 30, 48]
    for lo, hi in itertools.pairwise(bounds):
        out_rows_part(h, state, weight[lo:hi], lo, hi, last=hi == 48, chunk=16)
    exact = kept.double() @ weight.double().T
    assert torch.equal(h, h0 + exact.to(torch.bfloat16))
    assert state.out is None  # the last range let the kept output go
    per_slice = h0.clone()  # what adding partial sums over input slices would give
    for k0 in range(0, 96, 24):
        per_slice += (kept[:, k0 : k0 + 24].double() @ weight[:, k0 : k0 + 24].double().T).to(
            torch.bfloat16
        )
    assert not torch.equal(per_slice, h)


def test_engine_threads_are_not_left_behind(index: ModelIndex) -> None:
    before = {t.name for t in threading.enumerate()}
    engine = PrefillEngine(index, budget=model_bytes(index) // 3, device="cpu")
    list(engine.prefill(list(range(30))))
    engine.close()
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith("tandem-")], left


def test_the_default_budget_holds_the_whole_model_and_its_reserve(index: ModelIndex) -> None:
    """Without --budget, a model that fits stays resident next to its activation reserve
    (the reserve is added to what the model needs, not taken out of it)."""
    engine = PrefillEngine(index, device="cpu", max_prompt_tokens=64, chunk_tokens=32)
    try:
        assert engine.plan.granularity == "resident"
        assert engine.budget == engine.plan.device_bytes + engine.activation_reserve
    finally:
        engine.close()


@pytest.mark.parametrize(("capability", "fused"), [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_a_card_without_flash_attention_chunks_its_queries(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], fused: bool
) -> None:
    """A Turing card (7.5: a used 2080 Ti, a T4) has no flash attention: SDPA with GQA falls
    to its MATH kernel there, and the queries must go in chunks (and be reserved so)."""
    from tandem.nodes.prefill.kernels import blocks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    blocks.cuda_capability.cache_clear()
    try:
        assert blocks.fused_attention("cuda", 2, 128) is fused
    finally:
        blocks.cuda_capability.cache_clear()
