"""`tandem plan`: the plan a prefill node would make for a model and a budget, its predicted
prefill time and bound, and from which prompt length remote prefill beats the Mac's own —
the router's cost model as a command (nodes/prefill/planning/cost.py, nodes/decode/router.py). Reads
only the safetensors headers: a directory of headers without data will do, or a config.json
alone (the checkpoint it describes). Hardware flags
describe another machine; each one left out is measured here in a few seconds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tandem.app.cli.args import add_model_arguments, model_path
from tandem.app.cli.plan_hardware import DEFAULT_NET_GBPS, PlanUsageError, hardware
from tandem.app.cli.plan_kv import KVWire, kv_wire, render_kv, wire_kv
from tandem.app.cli.plan_link import PcieLink, pcie_link, render_link
from tandem.app.cli.plan_model import ModelSummary, model_summary
from tandem.app.cli.plan_ranks import RanksReport, ranks_report, render_ranks
from tandem.app.cli.plan_tiers import Tiers, add_host_budget_argument, render_tiers, with_tiers
from tandem.nodes.contract.units import format_bytes, parse_size
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.model.shapes_index import shapes_index

if TYPE_CHECKING:
    from tandem.nodes.prefill.planning.cost import Device, Hardware, Prediction
    from tandem.nodes.prefill.planning.plan import Plan

TABLE_TOKENS = (1024, 4096, 16384)
Seconds = Callable[[int], float]  # prompt tokens → seconds
POSITIVE = ("tokens", "max_prompt_tokens", "pcie_gbps", "disk_gbps", "tflops", "net_gbps",
            "mac_tok_s", "batch", "devices")  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the prefill plan for a model and budget, its predicted time")
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--budget", default=None, help="device memory, weights and activations, e.g. 24GiB"
    )
    p.add_argument("--tokens", type=int, default=4096, help="prompt length to predict")
    p.add_argument(
        "--batch",
        type=int,
        default=4,
        metavar="N",
        help="also predict one pass serving N such prompts at once (default 4)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="as the node's: activations of a prompt this long are kept free in "
                   "--budget (cuda: 8192)")  # fmt: skip
    p.add_argument("--table", type=_lengths, default=TABLE_TOKENS, metavar="N,N,...",
                   help="prompt lengths of the table (default 1024,4096,16384)")  # fmt: skip
    add_host_budget_argument(p)
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        metavar="N",
        help="N cards in the prefill box, each its share of every layer",
    )
    p.add_argument(
        "--lanes",
        type=int,
        choices=[16, 8],
        default=16,
        help="each card's PCIe lanes with --devices: 16 (x16/x16) or 8 (x8/x8)",
    )
    hw = p.add_argument_group("hardware (another machine's; measured here when left out)")
    hw.add_argument("--pcie-gbps", type=float, default=None, help="host→device, Gbit/s")
    hw.add_argument("--disk-gbps", type=float, default=None, help="cold weight reads, Gbit/s")
    hw.add_argument("--tflops", type=float, default=None, help="matmul TFLOP/s, model dtype")
    net_help = f"to the Mac, Gbit/s (default {DEFAULT_NET_GBPS:g}, assumed)"
    hw.add_argument("--net-gbps", type=float, default=None, help=net_help)
    mac_help = "the Mac's own prefill tokens/s (default: assumed from its FLOP/s)"
    hw.add_argument("--mac-tok-s", type=float, default=None, help=mac_help)
    p.add_argument("--json", action="store_true")


@dataclass(frozen=True)
class PlanSummary:
    granularity: str
    n_slots: int
    slot_bytes: int
    loads_per_pass: int
    resident_layers: list[int]
    resident_bytes: int
    pool_bytes: int
    scratch_bytes: int
    bytes_per_pass: int  # streamed through the ring each pass
    activation_reserve_bytes: int  # kept free in the budget for a prompt of the longest
    max_prompt_tokens: int | None  # the longest prompt the node takes (None: any)
    resident_form: str = "packed"  # quantized resident layers: "packed", "partly", "dequantized"
    resident_float_bytes: int = 0  # what keeping them dequantized takes


@dataclass(frozen=True)
class Row:
    tokens: int
    predicted_wall_s: float
    tokens_per_s: float
    bound: str
    remote_s: float  # prefill here + KV to the Mac (router.predict_remote_s)
    local_s: float  # the Mac's own prefill
    fits: bool  # within the node's longest prompt (else it answers 413)
    bytes_streamed: int = 0  # per pass (MoE: the experts expected to be chosen)


@dataclass(frozen=True)
class Report:
    """Everything `tandem plan` prints (JSON: bytes, seconds, `_Bps`)."""

    model: ModelSummary
    device: str
    budget_bytes: int
    plan: PlanSummary
    tiers: Tiers  # device, RAM, disk
    hardware: Hardware
    source: dict[str, str]  # per rate: "given", "measured" (here) or "assumed"
    tokens: int
    fits: bool  # within the node's longest prompt (else it answers 413)
    predicted_wall_s: float
    disk_s: float
    copy_s: float
    compute_s: float
    bound: str
    tokens_per_s: float
    bytes_streamed: int  # in that pass (MoE: the experts expected to be chosen)
    table: list[Row]
    break_even_tokens: int | None  # the shortest prompt remote prefill is faster for
    break_even_limit: int  # searched up to this many tokens
    kv_wire: list[KVWire]  # the prompt's KV over the network at 16, 8 and 4 bits
    batch: BatchCost | None = None  # one pass serving `batch` such prompts (issue 46)
    pcie_link: PcieLink | None = None  # this machine's card's link (NVML); None: not read
    ranks: RanksReport | None = None  # --devices N: the node's ranks (plan_ranks.py)


@dataclass(frozen=True)
class BatchCost:
    """One weight pass serving `requests` prompts of `tokens` each, against as many lone
    passes (the node batches the prompts waiting when a pass starts)."""

    requests: int
    tokens: int  # each
    pass_s: float
    lone_s: float  # `requests` lone passes, one after another
    bound: str  # the pass's


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of prompt lengths: {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError("prompt lengths must be positive")
    return lengths


def run_plan(a: argparse.Namespace) -> int:
    a.model = model_path(a.model, a.models_dir)  # an id: its directory, found offline
    for flag in POSITIVE:
        if getattr(a, flag) is not None and not getattr(a, flag) > 0:
            raise PlanUsageError(f"--{flag.replace('_', '-')} must be positive")
    try:
        budget = None if a.budget is None else parse_size(a.budget)
    except ValueError as e:
        raise PlanUsageError(f"--budget: {e}") from None
    if budget is not None and budget <= 0:
        raise PlanUsageError("--budget must be positive")
    if any(a.model.glob("model*.safetensors*")):
        index = load_index(a.model, require_data=False)
    else:  # a config alone: the checkpoint it describes
        index = shapes_index(a.model)
    report = make_report(index, a, budget)
    print(json.dumps(asdict(report), indent=2) if a.json else render(report))
    return 0


def _device(a: argparse.Namespace) -> tuple[Device, bool]:
    """The device to plan for, and whether it is on this machine."""
    import torch

    here = torch.cuda.is_available()
    if a.device is None:
        return ("cuda" if here else "cpu"), True
    return a.device, a.device == "cpu" or here


def _default_budget(index: ModelIndex, device: Device, here: bool, reserve: int) -> int:
    import torch
    from tandem.nodes.prefill.planning.budget import default_budget

    if not here:
        raise PlanUsageError("--device cuda: no GPU here to size the budget from; give --budget")
    return default_budget(index, torch.device(device), reserve)


def make_report(index: ModelIndex, a: argparse.Namespace, budget: int | None) -> Report:
    from tandem.nodes.model.safetensors_format import ITEMSIZE
    from tandem.nodes.prefill.planning import cost
    from tandem.nodes.prefill.planning.budget import longest_prompt
    from tandem.nodes.prefill.planning.ram import request_tokens

    spec = index.spec
    device, here = _device(a)
    longest = longest_prompt(spec, device, a.max_prompt_tokens)
    whole_ops = cost.whole_ops_reserve(spec, longest, ITEMSIZE[index.dtype], device)
    budget = budget if budget is not None else _default_budget(index, device, here, whole_ops)
    plan = cost.node_plan(index, budget, longest, device)  # before measuring: fails fast
    held = (spec.kv_bytes_per_token, request_tokens(longest, spec.max_position_embeddings))
    plan, tiers = with_tiers(plan, a.host_budget, device, here, held)
    reserve = plan.reserve_bytes
    hw, source = hardware(index, a, device, here)
    busy = "measured" in (source["copy_Bps"], source["flops"])  # the card just worked
    link = pcie_link(busy, hw.copy_Bps) if device == "cuda" and here else None
    main = cost.predict(plan, index, a.tokens, hw)
    remote_s, local_s = _router(index, plan, hw)
    limit = longest or max(spec.max_position_embeddings, *a.table)  # for the break-even
    fits = lambda n: longest is None or n <= longest  # noqa: E731  else the node answers 413
    table = [cost.predict(plan, index, n, hw) for n in a.table]
    return Report(
        model=model_summary(index),
        device=device,
        budget_bytes=budget,
        plan=_summary(plan, reserve, longest),
        tiers=tiers,
        hardware=hw,
        source=source,
        tokens=a.tokens,
        fits=fits(a.tokens),
        predicted_wall_s=main.wall_s,
        disk_s=main.disk_s,
        copy_s=main.copy_s,
        compute_s=main.compute_s,
        bound=main.bound,
        tokens_per_s=main.tokens_per_s,
        bytes_streamed=main.bytes_per_pass,
        table=[_row(p, remote_s, local_s, fits(p.tokens)) for p in table],
        break_even_tokens=cost.break_even_tokens(remote_s, local_s, limit),
        break_even_limit=limit,
        kv_wire=kv_wire(index, a.tokens, hw.net_Bps),
        batch=_batch_cost(plan, index, a.batch, a.tokens, hw, main.wall_s),
        pcie_link=link,
        ranks=None if a.devices < 2 else ranks_report(
            index, plan, a.devices, a.lanes, a.tokens, hw, a.host_budget, device, here,
            main.wall_s, longest,
        ),
    )  # fmt: skip


def _batch_cost(
    plan: Plan, index: ModelIndex, n: int, tokens: int, hw: Hardware, lone_s: float
) -> BatchCost:
    from tandem.nodes.prefill.planning import cost

    one_pass = cost.predict_pass(plan, index, n, tokens, hw)
    return BatchCost(n, tokens, one_pass.wall_s, n * lone_s, one_pass.bound)


def _router(index: ModelIndex, plan: Plan, hw: Hardware) -> tuple[Seconds, Seconds]:
    """Remote and local prefill seconds by the router's own formulas: this plan's predicted
    pass as the peer's rate and the KV (sliding layers: their window) over `net_Bps`; the Mac
    at `mac_tok_s`."""
    from tandem.nodes.contract.cluster import Peer
    from tandem.nodes.decode.router import LocalRate, predict_remote_s
    from tandem.nodes.prefill.planning import cost

    kv = wire_kv(index)
    local = LocalRate(tok_s=hw.mac_tok_s)

    def remote_s(n: int) -> float:
        wall = cost.predict(plan, index, n, hw).wall_s
        peer = Peer(address="plan", prefill_tok_s=n / wall, link_Bps=hw.net_Bps)
        return predict_remote_s(n, kv.at(n), kv.layers, peer)

    def local_s(n: int) -> float:
        seconds = local.predict_s(n)
        assert seconds is not None  # its rate is set
        return seconds

    return remote_s, local_s


def _row(p: Prediction, remote_s: Seconds, local_s: Seconds, fits: bool) -> Row:
    n = p.tokens
    return Row(n, p.wall_s, p.tokens_per_s, p.bound, remote_s(n), local_s(n), fits,
               p.bytes_per_pass)  # fmt: skip


def _summary(plan: Plan, reserve: int, longest: int | None) -> PlanSummary:
    streamed = [ld for ld in plan.loads if not ld.resident]
    return PlanSummary(
        granularity=plan.granularity,
        n_slots=plan.n_slots,
        slot_bytes=plan.slot_bytes,
        loads_per_pass=len(streamed),
        resident_layers=list(plan.resident_layers),
        resident_bytes=plan.resident_bytes,
        pool_bytes=plan.pool_bytes,
        scratch_bytes=plan.scratch_bytes,
        bytes_per_pass=sum(ld.weight_bytes for ld in streamed),
        activation_reserve_bytes=reserve,
        max_prompt_tokens=longest,
        resident_form=plan.resident_form,
        resident_float_bytes=plan.resident_float_bytes,
    )


def _GBps(Bps: float) -> str:
    return f"{Bps / 1e9:.3g} GB/s"


def render(r: Report) -> str:
    """The human table."""
    m, p, hw = r.model, r.plan, r.hardware
    tag = {k: "" if v == "given" else f" ({v})" for k, v in r.source.items()}
    resident = ", ".join(map(str, p.resident_layers))
    longest = f"prompts up to {p.max_prompt_tokens} tokens" if p.max_prompt_tokens else "none"
    link = "PCIe" if r.device == "cuda" else "memcpy"  # a CPU reads straight into its slots
    n_resident = len(p.resident_layers)
    floats = p.resident_form != "packed"  # no pass dequantizes those again
    some = "some " if p.resident_form == "partly" else ""
    lines = [
        f"tandem plan — {m.name}: {m.layers} layers, {m.dtype}, {format_bytes(m.bytes)}; "
        f"{r.device}, budget {format_bytes(r.budget_bytes)}",
        f"  plan        {p.granularity} granularity: {p.n_slots} ring slots of "
        f"{format_bytes(p.slot_bytes)}, {p.loads_per_pass} loads per pass",
        f"  resident    {n_resident} layer{'' if n_resident == 1 else 's'}, "
        f"{format_bytes(p.resident_bytes)}"
        + (f" (layers {resident})" if resident else "")
        + (f", {some}kept dequantized (+{format_bytes(p.resident_float_bytes)})" if floats else ""),
        f"  per pass    {format_bytes(p.bytes_per_pass)} streamed",
        render_tiers(r.tiers),
        f"  activations {format_bytes(p.activation_reserve_bytes)} reserved ({longest})",
        f"  hardware    {link} {_GBps(hw.copy_Bps)}{tag['copy_Bps']}, disk {_GBps(hw.disk_Bps)}"
        f"{tag['disk_Bps']}, {hw.flops / 1e12:.3g} TFLOP/s{tag['flops']}",
        *render_link(r.pcie_link),
        f"  network     {_GBps(hw.net_Bps)}{tag['net_Bps']} to a Mac that prefills "
        f"{hw.mac_tok_s:.0f} tok/s{tag['mac_tok_s']}",
        f"  prefill     {r.tokens} tokens in {r.predicted_wall_s:.3g} s "
        f"({r.tokens_per_s:.0f} tok/s), {r.bound}-bound: disk {r.disk_s:.3g} s, "
        f"{link} {r.copy_s:.3g} s, compute {r.compute_s:.3g} s"
        + (f"; {format_bytes(r.bytes_streamed)} streamed" if m.experts else "")
        + ("" if r.fits else " — longer than the node takes (413)"),
        "",
        f"  {'tokens':>8} {'wall s':>9} {'tok/s':>8} {'bound':>8} {'remote s':>9} {'Mac s':>9}"
        f" {'streamed':>10}",
    ]
    lines += [
        f"  {row.tokens:>8} {row.predicted_wall_s:>9.3g} {row.tokens_per_s:>8.0f} "
        f"{row.bound:>8} {row.remote_s:>9.3g} {row.local_s:>9.3g}"
        f" {format_bytes(row.bytes_streamed):>10}"
        + ("" if row.fits else "  (over the longest prompt: 413)")
        for row in r.table
    ]
    if m.experts:
        e, k = m.experts
        lines.append(
            f"  experts     top-{k} of {e} per token: a pass reads the experts its tokens choose,"
            f" 1 - (1 - {k}/{e})^tokens of them (routing taken as uniform; a skewed router"
            " reads fewer)\n              resident layers keep all their experts: a fixed set,"
            " chosen before any prompt (which experts a prompt uses changes with each one)"
        )
    if (b := r.batch) is not None and b.requests > 1:
        lines.append(
            f"  a pass of {b.requests} prompts of {b.tokens} tokens: {b.pass_s:.3g} s, "
            f"{b.bound}-bound, against {b.lone_s:.3g} s for {b.requests} lone passes "
            f"({b.pass_s / b.lone_s:.2f}x): the prompts waiting when a pass starts share it"
        )
    lines += render_ranks(r.ranks) if r.ranks is not None else []
    lines += render_kv(r.tokens, r.kv_wire, m)
    n = r.break_even_tokens
    lines.append(
        f"\n  remote      never faster than the Mac up to {r.break_even_limit} tokens"
        if n is None
        else f"\n  remote      faster than the Mac from {n} tokens (prefill here + KV over the"
        " network, as the router predicts it)"
    )
    return "\n".join(lines)
