"""The `attention` section: which SDPA kernel a real prefill runs, at start 0 and after a
prefix, and which backends take its shapes."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from .context import Ctx, attempt, say
from .engines import engine_at
from .models import small_model, tokens
from .sizes import Json

ATTN_OP = re.compile(r"attention|sdpa|flash|cudnn", re.I)
ATTN_KERNEL = re.compile(r"flash|fmha|attention|attn|sdpa|cudnn|softmax", re.I)


def backend_of(ops: Iterable[str]) -> str:
    """Which SDPA backend a profile's aten ops show (the most specific one seen)."""
    names = " ".join(ops).lower()
    for key, backend in (
        ("cudnn", "CUDNN_ATTENTION"),
        ("flash", "FLASH_ATTENTION"),
        ("efficient", "EFFICIENT_ATTENTION"),
        ("math", "MATH"),
    ):
        if key in names:
            return backend
    return "unknown"


def profiled(fn: Callable[[], object], cuda: bool) -> Json:
    """The attention ops and kernels that `fn` launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
    except RuntimeError as e:  # no CUPTI: the aten ops still tell the backend
        if not cuda:
            raise
        seen = profiled(fn, cuda=False)
        return {**seen, "kernels_error": str(e).splitlines()[0][:200]}
    names = {e.name for e in prof.events()}
    ops = sorted(n for n in names if n.startswith("aten::") and ATTN_OP.search(n))
    kernels = sorted(
        {n[:160] for n in names if not n.startswith("aten::") and ATTN_KERNEL.search(n)}
    )
    return {"backend": backend_of(ops), "ops": ops, "kernels": kernels}


def sdpa_backends(spec: Any, dtype: Any, device: str, count: int, start: int) -> Json:
    """Each SDPA backend alone on blocks.attention_part's call: whether it takes it, and what
    it ran (a lower-right causal bias may pick its kernel itself)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    D, S = spec.head_dim, start + count
    q = torch.randn(1, spec.num_heads, count, D, dtype=dtype, device=device)
    k = torch.randn(1, spec.num_kv_heads, S, D, dtype=dtype, device=device)
    v = torch.randn_like(k)
    causal: Json = (
        {"is_causal": True} if start == 0 else {"attn_mask": causal_lower_right(count, S)}
    )
    return each_backend(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5, enable_gqa=True, **causal),
        device == "cuda",
    )


def each_backend(call: Callable[[], object], cuda: bool) -> Json:
    """`call` under each SDPA backend alone: whether it takes it, and what it ran."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: Json = {}
    for backend in SDPBackend.__members__.values():
        if backend.name in ("ERROR", "OVERRIDEABLE"):
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    seen = profiled(call, cuda)
                out[backend.name] = {"ok": True, "ran": seen["backend"]}
            except RuntimeError as e:
                why = [str(w.message).splitlines()[0][:200] for w in caught]
                why = [w for w in why if not w.startswith("No viable backend")][:4]
                out[backend.name] = {"ok": False, "why": why or [str(e).splitlines()[0][:200]]}
    return out


def window_of(ctx: Ctx, dtype: str) -> Json:
    """A sliding-window layer's attention (Gemma 3 270M's shape: 4 heads, 1 KV head, head
    dim 256, window 512): one query chunk after a long prefix under its band mask, through
    blocks.band_attention as the engine calls it (the keys repeated to every query head on
    CUDA). The kernel SDPA picks, and each backend alone (flash takes no mask: the band runs
    on the efficient kernel; issue 48: with GQA it could only run MATH)."""
    import torch
    from tandem.nodes.prefill.kernels.blocks import band_attention, band_mask

    window, chunk, start, D = 512, 256, 2048, 256
    tdtype = getattr(torch, dtype)
    k_lo = start - window + 1
    q = torch.randn(1, 4, chunk, D, dtype=tdtype, device=ctx.device)
    k = torch.randn(1, 1, start + chunk - k_lo, D, dtype=tdtype, device=ctx.device)
    v = torch.randn_like(k)
    mask = band_mask(start, start + chunk, k_lo, window, q.device)

    def call() -> object:
        return band_attention(q, k, v, mask, D**-0.5)

    picked = profiled(call, ctx.cuda)
    say(f"attention {dtype}, sliding window band: {picked['backend']}")
    return {"window": window, "chunk": chunk, "start": start, "head_dim": D, **picked,
            "backends": each_backend(call, ctx.cuda)}  # fmt: skip


def attention_of(ctx: Ctx, dtype: str) -> Json:
    """A one-layer model's prefill, profiled at start 0 and after a prefix, and each SDPA
    backend tried alone on the same shapes."""
    import torch
    from tandem.nodes.model import load_index

    index = load_index(small_model(ctx, "attn", ctx.sizes.attn_model, dtype))
    spec, n = index.spec, ctx.sizes.attn_tokens
    ids, half = tokens(n, spec.vocab_size), n // 2
    engine = engine_at(index, index.total_bytes, ctx.device, ctx.sizes.chunk)
    try:
        list(engine.prefill(ids[:16]))  # warm-up: the resident load, lazy CUDA init
        prefix = [(kv.k, kv.v) for kv in engine.prefill(ids[:half])]
        start0 = profiled(lambda: list(engine.prefill(ids)), ctx.cuda)
        later = profiled(
            lambda: list(engine.prefill(ids[half:], start=half, prefix=prefix)), ctx.cuda
        )
    finally:
        engine.close()
    tdtype = getattr(torch, dtype)
    start0["backends"] = sdpa_backends(spec, tdtype, ctx.device, n, 0)
    later["backends"] = sdpa_backends(spec, tdtype, ctx.device, n - half, half)
    say(f"attention {dtype}: start 0 → {start0['backend']}, start > 0 → {later['backend']}")
    return {
        "shape": {
            "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
        },
        "start_0": {"start": 0, "tokens": n, **start0},
        "start_gt_0": {"start": half, "tokens": n - half, **later},
    }


def torch_capability() -> tuple[int, int]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major, minor


def attention_section(ctx: Ctx) -> Json:
    """Which kernel a real prefill's attention runs, at start 0 and after a prefix."""
    out = {dtype: attempt(attention_of, ctx, dtype) for dtype in ("bfloat16", "float32")}
    ran = [out[d].get(c, {}).get("backend") for d in out for c in ("start_0", "start_gt_0")]
    out["sliding_window"] = attempt(window_of, ctx, "bfloat16")
    out["ok"] = all(r not in (None, "unknown") for r in ran)
    if ctx.cuda:  # issue 17 defect 1: bf16 on CUDA must not fall back to MATH; issue 48:
        # nor a sliding window's band on an Ampere or later card
        band = out["sliding_window"].get("backend")
        ampere = torch_capability() >= (8, 0)
        out["ok"] = out["ok"] and "MATH" not in ran[:2] and not (ampere and band == "MATH")
    return out
