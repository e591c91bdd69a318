"""Issue 48 item 5: the prefill cost model's work per part kind is what the prefill computes
(a Qwen3.5 linear layer's mixer and a Qwen3.5-MoE's shared expert were modelled as attention:
~7x and ~1900x their FLOPs at 4k tokens), and a quantized model's loads pay for dequantizing
their weights where the plan dequantizes them.

FLOPs are checked against torch's FLOP counter over the prefill's own code; dequantized bytes
against what `dequantize` writes in a pass; a Qwen3.5-MoE-shaped model (safetensors headers
only) on a 4090-like box is link-bound at 4k tokens. The predicted 2k-token passes of made
Qwen3.5 models against measured ones on this CPU: test_cost_model_cpu.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from tandem.nodes.model.factory import MakeModelArgs
from tandem.nodes.model.factory_qwen3_5 import qwen3_5_config
from tandem.nodes.model.index import load_index
from tandem.nodes.model.qwen3_5_config import linear_shapes
from tandem.nodes.model.spec import LinearSpec
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.families import qwen3_5
from tandem.nodes.prefill.kernels import dequant
from tandem.nodes.prefill.kernels.linear_mixer import RULE_CHUNK, linear_mixer
from tandem.nodes.prefill.planning import cost, work
from tandem.nodes.prefill.planning.loads import Load, Part, dequantized_bytes
from torch.utils.flop_counter import FlopCounterMode

from tests.conftest import MakeTiny
from tests.test_plan_cmd import plan_json, write_headers_only

TINY_MOE = {"arch": "qwen3_5_moe", "layers": 4, "hidden": 64, "experts": 8, "top_k": 2,
            "moe_intermediate": 64, "shared_intermediate": 64, "linear_v_dim": 48}  # fmt: skip


def _solve_flops(lin: LinearSpec, chunks: int) -> int:
    """The delta rule's unit-triangular solves (the FLOP counter counts only mm and bmm)."""
    return lin.num_v_heads * chunks * RULE_CHUNK**2 * (lin.head_k_dim + lin.head_v_dim)


def test_the_linear_mixer_runs_the_flops_its_work_counts(tiny_model: MakeTiny) -> None:
    """Projections as mm, the chunked delta rule as bmm plus its solves; linear in tokens."""
    lin, H, T, block = LinearSpec(2, 4, 32, 48, 4), 64, 300, 128
    spec = dataclasses.replace(load_index(tiny_model(**TINY_MOE)).spec, hidden_size=H, linear=lin)
    w = {k: torch.randn(shape) for k, shape in linear_shapes(lin, H, False).items()}
    w["linear_attn.A_log"] = torch.zeros(lin.num_v_heads)
    conv = torch.zeros(lin.conv_kernel - 1, lin.conv_dim)
    state = torch.zeros(lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)
    with FlopCounterMode(display=False) as counter:
        linear_mixer(torch.randn(T, H), w, lin, 1e-6, conv, state, block)
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    got = work.linear_work(spec, T, 4, block)
    chunks = 2 + 2 + 1  # blocks of 128, 128, 44 tokens, each in chunks of 64
    assert counted["aten.mm"] == got.matmul == 2 * T * H * (lin.conv_dim + 2 * 192 + 2 * 4)
    assert counted["aten.bmm"] == got.recurrence - _solve_flops(lin, chunks)
    assert got.attention == 0
    double, single = (work.linear_work(spec, n, 4, block) for n in (512, 256))
    assert (double.matmul, double.recurrence) == (2 * single.matmul, 2 * single.recurrence)


def test_each_part_kind_counts_the_flops_the_prefill_runs(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A made Qwen3.5-MoE's pass, part by part under the FLOP counter: the linear mixer, the
    gated attention, the router and the shared expert as their work says (the old model took
    the mixer and the shared expert for attention, quadratic in tokens); the experts, grouped
    GEMMs the counter does not see, by their formula."""
    index = load_index(tiny_model(**TINY_MOE))
    spec, T, chunk = index.spec, 100, 128  # one query chunk: causal from 0, no lower-right bias
    counted: Counter[str] = Counter()
    modelled: Counter[str] = Counter()
    real = qwen3_5.Qwen35Family.compute

    def counting(self, p, part: Part, weights, h, state):  # type: ignore[no-untyped-def]
        with FlopCounterMode(display=False) as counter:
            done = real(self, p, part, weights, h, state)
        counted[part.op] += counter.get_total_flops()
        modelled[part.op] += cost.load_work(spec, _alone(part), T, 0, "cpu", 4, chunk).matmul
        return done

    engine = PrefillEngine(index, device="cpu", chunk_tokens=chunk)
    try:
        ids = np.random.default_rng(0).integers(0, 512, T).tolist()
        monkeypatch.setattr(qwen3_5.Qwen35Family, "compute", counting)
        list(engine.prefill(ids))
    finally:
        engine.close()
    lin, moe, H = spec.linear, spec.moe, spec.hidden_size
    assert lin is not None and moe is not None
    nq, D = spec.num_heads, spec.head_dim
    rule = 3 * (work.recurrence_work(lin, T, chunk) - _solve_flops(lin, 2))  # 3 linear layers
    o_proj = 2 * T * nq * D * H  # an in-place addmm_, which the counter does not see
    assert dict(counted) == {
        "linear": modelled["linear"] + rule, "shared": modelled["shared"],
        "router": modelled["router"], "attn": modelled["attn"] - o_proj,
    }  # fmt: skip
    assert modelled["shared"] == 4 * 2 * T * H * (3 * 64 + 1)  # four layers
    assert modelled["router"] == 4 * 2 * T * H * moe.num_experts
    # q_proj holds a gate per head: 2·nq heads' rows
    assert modelled["attn"] == 2 * T * H * D * (nq + 2 * nq + 2 * spec.num_kv_heads)
    experts = [p for ld in engine.plan.loads for p in ld.parts if p.op == "experts"]
    routed = math.ceil(T * moe.experts_per_token / moe.num_experts)  # per expert, expected
    assert sum(cost.load_work(spec, _alone(p), T, 0, "cpu", 4).matmul for p in experts) == (
        len(experts) * 2 * routed * H * moe.intermediate_size * 3
    )


def _alone(part: Part) -> Load:
    """A load of just `part`."""
    return Load(0, part.layer, (part,), (0,) * len(part.pieces), 0, True, True, False)


def test_a_linear_layer_costs_the_same_after_any_prefix(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(**TINY_MOE))
    plan = cost.node_plan(index, 10**9)
    mixer = next(ld for ld in plan.loads if any(p.op == "linear" for p in ld.parts))
    spec = index.spec
    fresh, late = (cost.load_work(spec, mixer, 4096, s, "cuda", 2) for s in (0, 100_000))
    assert fresh == late and fresh.attention == 0


# --- dequantization ------------------------------------------------------------------------


def _count_dequantized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each `dequantize` call of a pass writes (every module that calls it)."""
    from tandem.nodes.prefill.families import llama
    from tandem.nodes.prefill.kernels import experts

    made: list[int] = []
    real = dequant.dequantize

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        made.append(out.numel() * out.element_size())
        return out

    for module in (dequant, llama, experts):
        monkeypatch.setattr(module, "dequantize", counting)
    return made


@pytest.mark.parametrize("budget", ["streamed", "resident"])
def test_a_pass_dequantizes_what_the_model_says(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    """A made 4-bit Qwen3.5-MoE: the bytes `dequantize` writes in a warm pass are the plan's
    streamed and packed resident loads' matrices, each expert once a token chose it (64
    tokens choose all 8), none of the resident loads kept in float."""
    index = load_index(tiny_model(**TINY_MOE, quantize=4))
    layers = sum(index.layer_bytes(i) for i in range(4))
    engine = PrefillEngine(index, budget=layers if budget == "streamed" else 10**9, device="cpu",
                           host_budget=0)  # fmt: skip
    engine.route_experts = "always"
    plan, T = engine.plan, 64
    try:
        ids = np.random.default_rng(1).integers(0, 512, T).tolist()
        list(engine.prefill(ids))  # warm-up: the resident ones dequantized once, if kept so
        made = _count_dequantized(monkeypatch)
        list(engine.prefill(ids))
    finally:
        engine.close()
    packed = [ld for ld in plan.loads if ld.seq not in plan.resident_floats]
    if budget == "streamed":
        assert plan.n_slots and any(not ld.resident for ld in packed)
    else:
        assert plan.resident_floats and all(ld.resident for ld in plan.loads)
    parts = [p for ld in packed for p in ld.parts]
    assert all(dequantized_bytes(index, p, 4) <= plan.scratch_bytes for p in parts)
    expected = sum(work.dequant_work(index, ld, T, plan.scratch_bytes, 4).dequant for ld in packed)
    assert index.spec.moe is not None and index.spec.moe.expected_share(T) > 0.9999
    assert sum(made) == pytest.approx(expected, rel=1e-3)
    assert sum(made) == sum(dequantized_bytes(index, p, 4) for p in parts)


def test_a_scratch_for_one_matrix_dequantizes_again_per_chunk(tiny_model: MakeTiny) -> None:
    index = load_index(tiny_model(**TINY_MOE, quantize=4))
    plan = cost.node_plan(index, 10**9)
    for load in plan.loads:
        for part in load.parts:
            once = dequantized_bytes(index, part, 4)
            alone, T = _alone(part), 1000  # two chunks of 512
            roomy, tight = (work.dequant_work(index, alone, T, s, 4).dequant for s in (once, 0))
            share = index.spec.moe.expected_share(T) if part.op == "experts" else 1  # type: ignore[union-attr]
            assert roomy == pytest.approx(once * share)
            assert tight == (2 * roomy if part.op in work.PER_CHUNK else roomy)


def test_dequantizing_is_its_own_rate_outside_the_overhead() -> None:
    hw = cost.Hardware("cuda", 1.0, 1.0, flops=1e12, net_Bps=1.0, mac_tok_s=1.0, overhead=2.0)
    assert cost.Work(matmul=1e12, dequant=2e11).seconds(hw) == pytest.approx(2.0 + 2.0)
    assert cost.Work(dequant=1e9).seconds(cost.Hardware(**{**hw.__dict__, "dequant_Bps": 1e9})) == 1


def test_a_70b_at_4_bits_dequantizes_its_packed_layers_every_pass(tmp_path: Path) -> None:
    """Issue 48: on a 4090 a 70B at 4 bits whose layers all stay packed pays ~1.4 s a pass for
    dequantizing its 137 GB of bf16 weights (the stated CUDA rate); streamed at 8 GiB here."""
    index = load_index(write_headers_only(tmp_path / "70b", bits=4), require_data=False)
    plan = cost.node_plan(index, 8 << 30, 4096, "cuda")
    assert not plan.resident_floats
    hw = cost.Hardware("cuda", 25e9, 6.25e9, 150e12, 1.25e9, 400)
    free = cost.Hardware(**{**hw.__dict__, "dequant_Bps": math.inf})
    with_dq, without = (cost.predict(plan, index, 4096, h).compute_s for h in (hw, free))
    assert with_dq - without == pytest.approx(136.9e9 / work.DEQUANT_Bps["cuda"], rel=0.01)


# --- a Qwen3.5-MoE-shaped model, headers only ---------------------------------------------

# hidden 2048, 40 layers (every 4th full attention, 16 heads of 256 over 2 KV heads), linear
# layers of 16 key and 32 value heads of 128, 256 experts of 512 (top 8), a shared one of 512
QWEN35_MOE = MakeModelArgs(
    arch="qwen3_5_moe", layers=40, hidden=2048, heads=16, kv_heads=2, head_dim=256,
    intermediate=512, vocab=248320, dtype="bfloat16", experts=256, top_k=8,
    moe_intermediate=512, shared_intermediate=512, linear_k_heads=16, linear_v_heads=32,
    linear_k_dim=128, linear_v_dim=128, max_position_embeddings=262144, layout="hf",
)  # fmt: skip


def write_qwen35_moe_headers(out: Path, a: MakeModelArgs = QWEN35_MOE) -> Path:
    """`a` as one safetensors file of headers (bf16, Hugging Face's fused experts), no data."""
    H, D, E, inter = a.hidden, a.head_dim or a.hidden // a.heads, a.experts, a.moe_intermediate
    config = qwen3_5_config(a, D, 0, 0)  # type: ignore[arg-type]
    lin = LinearSpec(a.linear_k_heads, a.linear_v_heads, a.linear_k_dim, a.linear_v_dim,
                     a.conv_kernel)  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (a.vocab, H), "model.norm.weight": (H,),
        "lm_head.weight": (a.vocab, H),
    }  # fmt: skip
    for i in range(a.layers):
        layer = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
                 "mlp.gate.weight": (E, H), "mlp.experts.gate_up_proj": (E, 2 * inter, H),
                 "mlp.experts.down_proj": (E, H, inter), "mlp.shared_expert_gate.weight": (1, H),
                 **{f"mlp.shared_expert.{m}_proj.weight": (a.shared_intermediate, H)
                    for m in ("gate", "up")},
                 "mlp.shared_expert.down_proj.weight": (H, a.shared_intermediate)}  # fmt: skip
        if (i + 1) % a.full_attention_interval:
            layer |= linear_shapes(lin, H, hf_conv=True)
        else:
            layer |= {"self_attn.q_proj.weight": (2 * a.heads * D, H),
                      "self_attn.k_proj.weight": (a.kv_heads * D, H),
                      "self_attn.v_proj.weight": (a.kv_heads * D, H),
                      "self_attn.o_proj.weight": (H, a.heads * D),
                      "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)}  # fmt: skip
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_qwen35_moe_at_4k_on_a_4090_is_link_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: a 24 GiB card, 25 GB/s PCIe, 150 TFLOP/s, the streamed layers in a RAM
    tier: 4k tokens were predicted 16.0 s compute-bound; they are PCIe-bound, ~2.1 s."""
    model = write_qwen35_moe_headers(tmp_path / "qwen35-moe")
    hw = ["--pcie-gbps", "200", "--tflops", "150", "--net-gbps", "10", "--mac-tok-s", "400"]
    r = plan_json(capsys, "--model", model, "--budget", "24GiB", "--tokens", "4096",
                  "--device", "cuda", "--host-budget", "64GiB", *hw)  # fmt: skip
    assert r["model"]["bytes"] > 60e9 and r["disk_s"] == 0
    assert r["bound"] == "pcie" and r["compute_s"] < r["copy_s"] / 10
    floor = r["bytes_streamed"] / r["hardware"]["copy_Bps"]
    assert floor <= r["predicted_wall_s"] <= 1.02 * floor
