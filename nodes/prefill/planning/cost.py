"""The prefill node's cost model: how long one pass of a plan takes on given hardware.

`predict` replays the ring as a discrete-event simulation (`simulate`), mirroring
`streamer.py` and `movers.py`: one loader thread takes loads in plan order; a streamed load
goes to ring slot `k mod n_slots` (k counts streamed loads) and is read only once the slot's
previous occupant is released; compute takes loads in order, each once it is in memory and
the one before it is done. Resident loads are warm (loaded at warm-up): no read, no copy.

- CPU: the slot is host memory and the read lands in it; a slot is released when its compute
  ends. `copy_Bps` is the emulated link (`--link-gbps`), which caps the whole fill, or the
  memcpy rate when calibrated (then no cap).
- CUDA: the read lands in one of `N_STAGING` pinned buffers, taken in turn and refilled
  once their last copy is done; the copy crosses PCIe on one copy stream after the slot's
  previous occupant's compute; the loader reads on while it runs; a slot is released as soon
  as its compute is queued.
- The RAM tier (`Plan.host_loads`): a warm pass reads those loads from RAM, not from disk —
  no read on CUDA (the copy starts from the tier's pinned buffer), the copy (memcpy or the
  emulated link) on a CPU. Only the rest of the streamed set pays `disk_Bps`.

What each load computes and its seconds at the hardware's rates: `work.py` (a quantized
model's loads also dequantize their weights: every streamed one each pass, and the resident
ones but those the plan keeps dequantized, `Plan.resident_floats`); the rates of this
machine: `calibration.py` (its names are exported here too, for `tandem plan`).
Rates are bytes/s and FLOP/s; times seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.engine import DEFAULT_CHUNK_TOKENS, plan_for_prompts, prompt_activations
from tandem.nodes.prefill.planning.calibration import (
    calibrate,
    loader_contention,
    measure_attention_flops,
    measure_copy_Bps,
    measure_dequant_Bps,
    measure_elementwise_Bps,
    measure_flops,
    measure_overhead,
    measure_recurrence_flops,
)
from tandem.nodes.prefill.planning.disk_probe import measure_disk_Bps
from tandem.nodes.prefill.planning.plan import Plan
from tandem.nodes.prefill.planning.work import Device, Hardware, Work, dequant_work, load_work
from tandem.nodes.prefill.stream.movers import N_STAGING
from tandem.nodes.prefill.stream.routing import ALL_EXPERTS

__all__ = [  # what `tandem plan` and its tests take from here
    "Bound", "Device", "Hardware", "Prediction", "Step", "Work", "break_even_tokens",
    "calibrate", "load_work", "loader_contention", "measure_attention_flops",
    "measure_copy_Bps", "measure_dequant_Bps", "measure_disk_Bps", "measure_elementwise_Bps",
    "measure_flops", "measure_overhead", "measure_recurrence_flops", "node_plan", "predict",
    "simulate", "steps", "whole_ops_reserve",
]  # fmt: skip

Bound = Literal["pcie", "disk", "compute"]


@dataclass(frozen=True)
class Step:
    """One load as the simulator sees it (seconds)."""

    read_s: float  # disk → host memory (the slot itself on a CPU, staging on CUDA)
    copy_s: float  # host → device; CPU: what the emulated link adds to the fill
    compute_s: float
    streamed: bool  # through the ring; False: resident, already in memory
    staged: bool = True  # CUDA: through a staging buffer; False: from the RAM tier's own
    routed: bool = False  # read once the previous load's compute (its router) is done
    nbytes: int = 0  # read (a routed load: its expected share)


@dataclass(frozen=True)
class Prediction:
    """One predicted pass over `tokens` new positions after `start`."""

    tokens: int
    start: int
    wall_s: float
    disk_s: float  # sum over streamed loads
    copy_s: float  # sum over streamed loads (host → device)
    compute_s: float  # sum over all loads
    bound: Bound
    bytes_per_pass: int  # streamed through the ring
    ram_bytes: int = 0  # of bytes_per_pass, from the RAM tier
    disk_bytes: int = 0  # of bytes_per_pass, from disk

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.inf


def whole_ops_reserve(
    spec: ModelSpec, tokens: int | None, itemsize: int, device: Device,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> int:  # fmt: skip
    """Bytes a node keeps free for the activations of a `tokens` prompt when it cuts no op
    (what a resident model needs; 0 for None): engine.py's default budget adds it."""
    return prompt_activations(spec, tokens or 0, 0, chunk, itemsize, device, cut_ops=False)


def node_plan(
    index: ModelIndex, budget: int, tokens: int | None = None, device: Device = "cpu",
    host_bytes: int = 0,
) -> Plan:  # fmt: skip
    """The plan a prefill node makes for `budget` bytes, room kept for the activations of a
    `tokens` prompt (engine.plan_for_prompts), with a RAM tier of `host_bytes`."""
    plan = plan_for_prompts(index, budget, tokens, device)
    return plan.with_host(host_bytes) if host_bytes else plan


def steps(
    plan: Plan, index: ModelIndex, tokens: int, hw: Hardware, start: int = 0,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> list[Step]:  # fmt: skip
    """The plan's loads as simulator steps on `hw`."""
    itemsize = ITEMSIZE[index.dtype]
    share = experts_share(index.spec, tokens)
    routed = share < ALL_EXPERTS  # else every expert is read, with no wait for the router
    out = []
    for load in plan.loads:
        work = load_work(index.spec, load, tokens, start, hw.device, itemsize, chunk)
        if index.quantized and load.seq not in plan.resident_floats:  # dequantized each pass
            work += dequant_work(index, load, tokens, plan.scratch_bytes, itemsize, chunk)
        compute_s = work.seconds(hw)
        if load.resident:
            out.append(Step(0.0, 0.0, compute_s, streamed=False))
            continue
        nbytes = round(load.weight_bytes * share) if load.routed and routed else load.weight_bytes
        read_s, copy_s = nbytes / hw.disk_Bps, nbytes / hw.copy_Bps
        held = load.seq in plan.host_loads  # warm: in RAM already, copied from there
        if held:
            read_s = 0.0
        if hw.device == "cpu":  # the link caps the whole fill, the read included
            copy_s = max(0.0, copy_s - read_s)
        out.append(Step(read_s, copy_s, compute_s, True, not held, load.routed and routed, nbytes))
    return out


def experts_share(spec: ModelSpec, tokens: int) -> float:
    """The expected share of a layer's experts `tokens` tokens choose (`MoeSpec`; checked
    against made models in tests/test_moe_plan.py); 1 for a model without experts."""
    return spec.moe.expected_share(tokens) if spec.moe is not None else 1.0


def simulate(run: Sequence[Step], n_slots: int, staging: int = 0) -> float:
    """Seconds from the first read to the end of the last compute.

    `staging` = 0: each read lands in its slot and the fill (read, then `copy_s`) holds the
    loader; a slot is released when its compute ends (CPU). `staging` > 0: reads land in
    that many buffers taken in turn, copies run on their own stream after the slot's last
    compute, and a slot is released when its compute is queued (CUDA); a load from the RAM
    tier (`staged=False`) is copied from the tier's own pinned buffer, no staging taken.
    """
    loader = copy_free = compute_end = 0.0
    released: list[float] = []  # per streamed load: when the loader may refill its slot
    computed: list[float] = []  # per streamed load: when its compute ended
    copied: list[float] = []  # per staged fill: when its copy ended (its buffer is free)
    for step in run:
        if not step.streamed:
            ready = loader  # warm: ready once the loader gets to it
        else:
            prev = len(released) - max(n_slots, 1)  # the slot's previous occupant
            read_start = max(loader, released[prev] if prev >= 0 else 0.0)
            if step.routed:  # its experts are chosen by the compute before it
                read_start = max(read_start, compute_end)
            if staging and step.staged and len(copied) >= staging:
                read_start = max(read_start, copied[-staging])
            read_end = read_start + step.read_s
            if staging:
                slot_free = computed[prev] if prev >= 0 else 0.0
                ready = max(read_end, copy_free, slot_free) + step.copy_s
                copy_free = ready
                if step.staged:
                    copied.append(ready)
                loader = read_end
            else:
                ready = loader = read_end + step.copy_s
        begin = max(ready, compute_end)
        compute_end = begin + step.compute_s
        if step.streamed:
            released.append(begin if staging else compute_end)
            computed.append(compute_end)
    return compute_end


def predict(
    plan: Plan, index: ModelIndex, tokens: int, hw: Hardware, start: int = 0,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Prediction:  # fmt: skip
    """Predicted warm pass of `tokens` new positions after `start` through `plan` on `hw`."""
    return _predicted(plan, steps(plan, index, tokens, hw, start, chunk), tokens, start, hw)


def predict_pass(
    plan: Plan, index: ModelIndex, requests: int, tokens: int, hw: Hardware,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> Prediction:  # fmt: skip
    """Predicted warm pass serving `requests` prompts of `tokens` each (issue 46): the weights
    streamed once (a mixture of experts: those all their tokens are expected to choose), each
    load computed once per prompt while it sits in its slot."""
    one = steps(plan, index, tokens, hw, 0, chunk)
    union = steps(plan, index, requests * tokens, hw, 0, chunk)  # the experts' bytes
    run = [
        dataclasses.replace(u, compute_s=requests * o.compute_s)
        for o, u in zip(one, union, strict=True)
    ]
    return _predicted(plan, run, requests * tokens, 0, hw)


def _predicted(plan: Plan, run: list[Step], tokens: int, start: int, hw: Hardware) -> Prediction:
    nbytes = sum(s.nbytes for s in run if s.streamed)
    from_disk = round(plan.disk_bytes * nbytes / plan.streamed_bytes) if plan.streamed_bytes else 0
    wall = simulate(run, plan.n_slots, N_STAGING if hw.device == "cuda" else 0)
    disk_s, copy_s = from_disk / hw.disk_Bps, nbytes / hw.copy_Bps
    compute_s = sum(s.compute_s for s in run)
    bound: Bound = "disk" if disk_s >= copy_s else "pcie"
    if compute_s >= max(disk_s, copy_s):
        bound = "compute"
    return Prediction(
        tokens, start, wall, disk_s, copy_s, compute_s, bound, nbytes, plan.ram_bytes, from_disk
    )


def break_even_tokens(
    remote_s: Callable[[int], float], local_s: Callable[[int], float], limit: int
) -> int | None:
    """The shortest prompt (tokens, up to `limit`) whose remote prefill is predicted faster
    than the local one, or None: doubles from 1, then bisects the last step."""
    faster = lambda n: remote_s(n) < local_s(n)  # noqa: E731
    lo, hi = 0, 1  # not faster at lo (0: nothing checked), faster at hi once found
    while not faster(hi):
        if hi >= limit:
            return None
        lo, hi = hi, min(2 * hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if faster(mid) else (mid, hi)
    return hi
