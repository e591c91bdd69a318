"""The prefill node's KV quantizer against `mx.quantize`, bit for bit: packed words, scales
and biases for random, outlier, constant, zero, tiny, huge and tie-prone groups in float32,
float16 and bfloat16, at every supported bit width and group size."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
import torch
from tandem.nodes.prefill.kernels.kv_quant import Scratch, quantize, quantize_all

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MX_DTYPE = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
D = 384  # columns of the made inputs: whole groups at every group size


def _mx(t: torch.Tensor) -> mx.array:
    """A torch tensor's exact bits as an mlx array (bf16 through its uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    if t.dtype == torch.uint32:
        return mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
    return mx.array(t.numpy())


def _bits(a: mx.array) -> np.ndarray:
    """An mlx array's raw bits as integers."""
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.array(a.view(width))


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's raw bits as unsigned integers."""
    size = t.element_size()
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]  # what numpy takes
    return t.contiguous().view(signed).numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])


def _assert_like_mlx(x: torch.Tensor, group: int, bits: int) -> None:
    words, scales, biases = quantize(x, group, bits)
    ref = mx.quantize(_mx(x), group_size=group, bits=bits)
    assert words.dtype == torch.uint32 and scales.dtype == biases.dtype == x.dtype
    for name, ours, theirs in zip(
        ("words", "scales", "biases"), (words, scales, biases), ref, strict=True
    ):
        assert tuple(ours.shape) == theirs.shape, name
        diff = np.flatnonzero(_torch_bits(ours).ravel() != _bits(theirs).ravel())
        assert diff.size == 0, f"{name}: {diff.size} differ, first at {diff[:5]}"
    ours_w = mx.dequantize(_mx(words), _mx(scales), _mx(biases), group_size=group, bits=bits)
    mlx_w = mx.dequantize(*ref, group_size=group, bits=bits)
    assert np.array_equal(_bits(ours_w), _bits(mlx_w))


def _groups(
    rows: int, group: int, fill: Callable[[int, torch.Generator], torch.Tensor]
) -> torch.Tensor:
    """[rows, D] float32, each group drawn by `fill(group, generator)`."""
    gen = torch.Generator().manual_seed(rows * 7 + group)
    return torch.stack([fill(group, gen) for _ in range(rows * D // group)]).view(rows, D)


def _constant(group: int, gen: torch.Generator) -> torch.Tensor:
    c = torch.randn((), generator=gen) * 10 ** float(torch.randint(-8, 5, (), generator=gen))
    return c.clamp(-6e4, 6e4).expand(group)  # finite in float16 too


def _one_sign(group: int, gen: torch.Generator) -> torch.Tensor:
    """All negative or all positive, so the max (or the min) is far from zero."""
    sign = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
    return sign * (1 + torch.rand(group, generator=gen) * torch.rand((), generator=gen) * 5)


def _symmetric(group: int, gen: torch.Generator) -> torch.Tensor:
    """|min| == |max|: the tie in the choice of the edge."""
    a = torch.rand(group, generator=gen) * 2 - 1
    a[0], a[1] = -3.0, 3.0
    return a


def _halves(bits: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    """min 0, max n_bins: scale -1, bias n_bins, so k + 0.5 lands exactly on a half."""
    n_bins = (1 << bits) - 1

    def fill(group: int, gen: torch.Generator) -> torch.Tensor:
        a = torch.randint(0, 2 * n_bins + 1, (group,), generator=gen).float() / 2
        a[0], a[1] = 0.0, float(n_bins)
        return a

    return fill


def _tiny_range(group: int, gen: torch.Generator) -> torch.Tensor:
    """A range under 255e-7, so the scale is mlx's 1e-7 floor; near 0, q0 is 0 and the bias 0."""
    if torch.rand((), generator=gen) < 0.5:
        return 1 + torch.randn(group, generator=gen) * 3e-8
    return torch.randn(group, generator=gen) * 1e-8  # |edge| / 1e-7 < 0.5


def _inputs(dtype: torch.dtype, group: int, bits: int) -> dict[str, torch.Tensor]:
    """Named [rows, D] inputs in `dtype`."""
    gen = torch.Generator().manual_seed(group * 10 + bits)
    normal = torch.randn(64, D, generator=gen)
    outliers = normal.clone()
    outliers[torch.rand(64, D, generator=gen) < 0.01] *= 100
    tiny = torch.randn(8, D, generator=gen) * {torch.float16: 1e-6}.get(dtype, 1e-30)
    huge = {torch.float16: 6e4, torch.bfloat16: 1e37, torch.float32: 1e30}[dtype]
    mixed = torch.randn(8, D, generator=gen) * huge
    if dtype == torch.float16:
        mixed = mixed.clamp(-65504, 65504)
        mixed[:, 0], mixed[:, 1] = 65504, -65504
    inputs = {
        "normal": normal,
        "outliers": outliers,
        "zero": torch.zeros(4, D),
        "constant": _groups(4, group, _constant),
        "one_sign": _groups(4, group, _one_sign),
        "symmetric": _groups(2, group, _symmetric),
        "halves": _groups(4, group, _halves(bits)),
        "tiny_range": _groups(4, group, _tiny_range),
        "tiny": tiny,
        "huge": mixed,
    }
    if dtype == torch.float32:  # subnormal inputs, range past float32's max, and constant
        inputs["subnormal"] = torch.randn(4, D, generator=gen) * 1e-40  # groups past 1e37
        inputs["overflow"] = torch.randn(4, D, generator=gen).sign() * 3e38  # that overflow
        inputs["huge_constant"] = torch.tensor([[1e38], [-1e38], [4e31], [1e36]]).expand(4, D)
    return {name: x.to(dtype) for name, x in inputs.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_is_mx_quantize_bit_for_bit(bits: int, group: int, dtype: torch.dtype) -> None:
    for name, x in _inputs(dtype, group, bits).items():
        try:
            _assert_like_mlx(x, group, bits)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("heads", "tokens", "head_dim"), [(8, 100, 64), (2, 37, 128)])
def test_kv_shaped_layers(heads: int, tokens: int, head_dim: int, bits: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(heads * tokens)
    # K-like: a few channels carry large offsets, as rotary keys do
    k = torch.randn(1, heads, tokens, head_dim, generator=gen)
    k[..., :: head_dim // 8] += 20 * torch.randn(heads, 1, 8, generator=gen)
    v = torch.randn(1, heads, tokens, head_dim, generator=gen) * 0.1
    for group in (g for g in (32, 64, 128) if head_dim % g == 0):
        for x in (k, v):
            x = x.to(dtype)
            _assert_like_mlx(x, group, bits)
            words, scales, _ = quantize(x, group, bits)
            assert words.shape == (1, heads, tokens, head_dim * bits // 32)
            assert scales.shape == (1, heads, tokens, head_dim // group)


def test_non_contiguous_input_is_read_by_value() -> None:
    x = torch.randn(1, 4, 64, 32).transpose(2, 3)  # [1, 4, 32, 64], not contiguous
    _assert_like_mlx(x, 64, 4)
    assert torch.equal(quantize(x, 64, 4)[0], quantize(x.contiguous(), 64, 4)[0])


def test_gpu_kernel_rounds_halves_away_from_zero() -> None:
    # 8 bits, min 0, max 255: scale -1, bias 255, value w quantizes to 255 - w
    x = torch.zeros(1, 32)
    x[0, 1], x[0, 2], x[0, 3] = 255.0, 2.5, 3.5
    q_cpu = quantize(x, 32, 8)[0].view(torch.uint8)[0]
    q_gpu = quantize(x, 32, 8, kernel="gpu")[0].view(torch.uint8)[0]
    assert q_cpu[:4].tolist() == [255, 0, 252, 252]  # 252.5 and 251.5 to even
    assert q_gpu[:4].tolist() == [255, 0, 253, 252]  # away from zero


def test_gpu_kernel_starts_the_max_at_zero() -> None:
    # all negative: the Metal/CUDA kernels see max 0, as mlx's CPU kernel does for the same
    # group with one of its (non-minimal) values replaced by 0
    x = -(1 + torch.rand(3, 64, generator=torch.Generator().manual_seed(3)))
    x[:, 0] = -3.0
    with_zero = x.clone()
    with_zero[:, 5] = 0.0
    words, scales, biases = quantize(x, 64, 8, kernel="gpu")
    ref_w, ref_s, ref_b = mx.quantize(_mx(with_zero), group_size=64, bits=8)
    assert np.array_equal(_torch_bits(scales), _bits(ref_s))
    assert np.array_equal(_torch_bits(biases), _bits(ref_b))
    ours, theirs = words.view(torch.uint8).numpy(), np.array(ref_w.view(mx.uint8))
    keep = np.arange(64) != 5
    assert np.array_equal(ours[:, keep], theirs[:, keep])
    assert not np.array_equal(_torch_bits(scales), _torch_bits(quantize(x, 64, 8)[1]))


def test_gpu_kernel_agrees_where_the_kernels_do() -> None:
    # every group holds a 0 (so max ≥ 0) and no value lands on a half
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(5))
    x[:, ::32] = 0.0
    for bits in (8, 4):
        ours = quantize(x, 32, bits, kernel="gpu")
        for o, r in zip(ours, mx.quantize(_mx(x), group_size=32, bits=bits), strict=True):
            assert np.array_equal(_torch_bits(o), _bits(r))


@pytest.mark.parametrize(
    ("shape", "group", "bits", "dtype"),
    [((4, 96), 64, 8, torch.float32), ((4, 64), 64, 3, torch.float32),
     ((4, 64), 16, 4, torch.float32), ((4, 64), 64, 4, torch.int32)],
)  # fmt: skip
def test_refuses_what_it_cannot_pack(
    shape: tuple[int, int], group: int, bits: int, dtype: torch.dtype
) -> None:
    with pytest.raises(ValueError):
        quantize(torch.zeros(shape, dtype=dtype), group, bits)


@pytest.mark.parametrize("kernel", ["cpu", "gpu"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_layers_k_and_v_together_are_each_quantized_alone(bits: int, kernel: str) -> None:
    # the scales' ops run once for both; the values must not see the other tensor's groups
    gen = torch.Generator().manual_seed(bits)
    k = torch.randn(1, 2, 40, 128, generator=gen).to(torch.bfloat16) * 30
    v = torch.randn(1, 2, 40, 128, generator=gen).to(torch.bfloat16)
    v[0, 1, :7] = -2.0  # constant groups in the second tensor only
    both = quantize_all((k, v), 64, bits, kernel=kernel)
    for x, got in zip((k, v), both, strict=True):
        for ours, alone in zip(got, quantize(x, 64, bits, kernel=kernel), strict=True):
            assert ours.shape == alone.shape
            assert np.array_equal(_torch_bits(ours), _torch_bits(alone))
    _assert_like_mlx(v, 64, bits)


def test_tensors_quantized_together_share_dtype_and_width() -> None:
    with pytest.raises(ValueError):
        quantize_all((torch.zeros(2, 64), torch.zeros(2, 128)), 64, 8)
    with pytest.raises(ValueError):
        quantize_all((torch.zeros(2, 64), torch.zeros(2, 64, dtype=torch.float16)), 64, 8)


def test_a_kept_scratch_gives_what_fresh_memory_does() -> None:
    # a scratch grown by a long prompt, then reused by shorter layers (and a float32 pair):
    # each call's results are its own, not views of working memory a later call overwrites
    gen = torch.Generator().manual_seed(5)
    scratch = Scratch()
    layers = [
        tuple(torch.randn(1, 2, n, 64, generator=gen).to(dtype) * 4 for _ in range(2))
        for n, dtype in ((50, torch.bfloat16), (9, torch.bfloat16), (30, torch.float32))
    ]
    kept = [quantize_all(kv, 32, 4, scratch=scratch) for kv in layers]
    for kv, got in zip(layers, kept, strict=True):
        for ours, fresh in zip(got, quantize_all(kv, 32, 4), strict=True):
            for a, b in zip(ours, fresh, strict=True):
                assert np.array_equal(_torch_bits(a), _torch_bits(b))
