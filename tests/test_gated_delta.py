"""The gated delta rule and Qwen3.5's linear-attention mixer in torch against mlx-lm."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tandem.nodes.model.spec import LinearSpec
from tandem.nodes.prefill.kernels.gated_delta import gated_delta_chunked, gated_delta_stepped
from tandem.nodes.prefill.kernels.linear_mixer import linear_mixer

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def Lin() -> LinearSpec:
    """A small linear-attention layer: 2 key heads of 16, 4 value heads of 8, conv of 4."""
    return LinearSpec(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, conv_kernel=4)


HIDDEN = 32
EPS = 1e-6


def _inputs(T: int, hk: int, hv: int, dk: int = 32, dv: int = 24, seed: int = 0) -> Inputs:
    """q, k as the mixer makes them (unit k, q scaled by Dk^-0.5), gates in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(T, hk, dk, generator=gen)
    q = torch.randn(T, hk, dk, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)
    q = q / q.norm(dim=-1, keepdim=True) * dk**-0.5
    v = torch.randn(T, hv, dv, generator=gen)
    g = torch.exp(-torch.rand(T, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(T, hv, generator=gen))
    return q, k, v, g, beta


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("hk, hv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("T, chunk", [(1, 16), (15, 16), (16, 16), (17, 16), (1000, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_stepped(hk: int, hv: int, T: int, chunk: int, with_state: bool) -> None:
    q, k, v, g, beta = _inputs(T, hk, hv)
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(hv, 24, 32, generator=gen) if with_state else torch.zeros(hv, 24, 32)
    y_ref, s_ref = gated_delta_stepped(q, k, v, g, beta, state)
    y, s = gated_delta_chunked(q, k, v, g, beta, state, chunk)
    assert y.shape == (T, hv, 24) and y.dtype == q.dtype
    assert s.shape == (hv, 24, 32) and s.dtype == torch.float32
    assert _rel(y, y_ref) <= 1e-5
    assert _rel(s, s_ref) <= 1e-5


def test_chunked_zero_gate_and_dtype() -> None:
    """A gate that underflowed to 0 (log = -inf) forgets the state, without NaN; the output
    takes q's dtype."""
    q, k, v, g, beta = _inputs(40, 2, 4)
    g[7] = 0.0
    state = torch.randn(4, 24, 32)
    y_ref, s_ref = gated_delta_stepped(q.bfloat16(), k.bfloat16(), v, g, beta, state)
    y, s = gated_delta_chunked(q.bfloat16(), k.bfloat16(), v, g, beta, state, 16)
    assert y.dtype == torch.bfloat16 and not y.float().isnan().any()
    assert _rel(y, y_ref) <= 1e-2
    assert _rel(s, s_ref) <= 1e-5


def test_stepped_matches_mlx_ops() -> None:
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta = _inputs(37, 2, 4)
    state = torch.randn(4, 24, 32)
    y, s = gated_delta_stepped(q, k, v, g, beta, state)
    args = [mx.array(t.numpy()[None]) for t in (q, k, v, g, beta, state)]
    y_mx, s_mx = gated_delta_ops(*args)
    assert _rel(y, torch.from_numpy(np.array(y_mx[0]))) <= 1e-5
    assert _rel(s, torch.from_numpy(np.array(s_mx[0]))) <= 1e-5


def _mlx_mixer(lin: Lin, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """An mlx-lm GatedDeltaNet with every parameter random, and its weights in torch keyed
    as the mixer reads them (conv1d in mlx's (C, K, 1) layout)."""
    mx = pytest.importorskip("mlx.core")
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

    args = TextModelArgs(
        hidden_size=HIDDEN,
        rms_norm_eps=EPS,
        linear_num_value_heads=lin.num_v_heads,
        linear_num_key_heads=lin.num_k_heads,
        linear_key_head_dim=lin.head_k_dim,
        linear_value_head_dim=lin.head_v_dim,
        linear_conv_kernel_dim=lin.conv_kernel,
    )
    mixer = GatedDeltaNet(args)
    mx.random.seed(seed)
    mixer.update(tree_map(lambda p: 0.3 * mx.random.normal(p.shape), mixer.parameters()))
    mixer.norm.weight = 1.0 + 0.2 * mx.random.normal(mixer.norm.weight.shape)
    mixer.eval()
    w = {
        f"linear_attn.{name}": torch.from_numpy(np.array(p))
        for name, p in tree_flatten(mixer.parameters())
    }
    return mixer, w


def _run_mlx(mixer: Any, cache: Any, x: torch.Tensor) -> torch.Tensor:
    import mlx.core as mx

    out = mixer(mx.array(x.numpy()[None]), cache=cache)
    mx.eval(out, cache[0], cache[1])
    return torch.from_numpy(np.array(out[0]))


def _cache_arrays(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(np.array(cache[0][0])), torch.from_numpy(np.array(cache[1][0]))


@pytest.mark.parametrize("hf_conv", [False, True])
def test_mixer_matches_mlx(hf_conv: bool) -> None:
    """A fresh prompt, then a second one continuing from the first's cache."""
    pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import ArraysCache

    lin = Lin()
    mixer, w = _mlx_mixer(lin, seed=3)
    if hf_conv:  # HF's (C, 1, K): the same bytes
        conv = w["linear_attn.conv1d.weight"]
        w["linear_attn.conv1d.weight"] = conv.reshape(conv.shape[0], 1, lin.conv_kernel)
    cache = ArraysCache(size=2)
    conv_state = torch.zeros(lin.conv_kernel - 1, lin.conv_dim)
    ssm_state = torch.zeros(lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)
    gen = torch.Generator().manual_seed(4)
    for T in (23, 2):
        x = torch.randn(T, HIDDEN, generator=gen)
        want = _run_mlx(mixer, cache, x)
        out, conv_state, ssm_state = linear_mixer(x, w, lin, EPS, conv_state, ssm_state, 8)
        want_conv, want_ssm = _cache_arrays(cache)
        assert out.shape == (T, HIDDEN) and _rel(out, want) <= 1e-4
        assert conv_state.shape == want_conv.shape and _rel(conv_state, want_conv) <= 1e-4
        assert ssm_state.shape == want_ssm.shape and _rel(ssm_state, want_ssm) <= 1e-4


def test_mixer_chunk_independent() -> None:
    lin = Lin()
    _, w = _mlx_mixer(lin, seed=5)
    x = torch.randn(70, HIDDEN, generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(7)
    conv_state = torch.randn(lin.conv_kernel - 1, lin.conv_dim, generator=gen)
    ssm_state = torch.randn(lin.num_v_heads, lin.head_v_dim, lin.head_k_dim, generator=gen)
    small = linear_mixer(x, w, lin, EPS, conv_state, ssm_state, 3)
    big = linear_mixer(x, w, lin, EPS, conv_state, ssm_state, 64)
    for got, want in zip(small, big, strict=True):
        assert _rel(got, want) <= 1e-5


def test_mixer_bf16_near_mlx() -> None:
    """In bf16 the dtypes follow mlx-lm's cache (conv rows bf16, state float32) and the
    output stays within bf16 rounding of mlx-lm's."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import ArraysCache

    lin = Lin()
    mixer, w = _mlx_mixer(lin, seed=8)
    mixer.set_dtype(mx.bfloat16)
    w = {name: t.bfloat16() for name, t in w.items()}
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(9)).bfloat16()
    cache = ArraysCache(size=2)
    out = mixer(mx.array(x.float().numpy()[None]).astype(mx.bfloat16), cache=cache)
    want = torch.from_numpy(np.array(out[0].astype(mx.float32)))
    want_conv = torch.from_numpy(np.array(cache[0][0].astype(mx.float32)))
    want_ssm = torch.from_numpy(np.array(cache[1][0]))
    conv_state = torch.zeros(lin.conv_kernel - 1, lin.conv_dim, dtype=torch.bfloat16)
    ssm_state = torch.zeros(lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)
    got, conv, ssm = linear_mixer(x, w, lin, EPS, conv_state, ssm_state, 16)
    assert (got.dtype, conv.dtype, ssm.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert torch.equal(conv.float(), want_conv)
    assert _rel(got, want) <= 3e-2
    assert _rel(ssm, want_ssm) <= 2e-2
