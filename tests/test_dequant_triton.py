"""The Triton dequantization kernel against the torch path, bit for bit, at every affine width.

The kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, read when triton is imported:
so in a subprocess of its own) on CPU tensors; `dequantize` on the CPU is the torch path, the
oracle (on CUDA it would pick the kernel). Skipped only where triton is not installed; the CPU
path never imports it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

CHILD = textwrap.dedent(
    """
    import itertools, json
    import torch
    from tandem.nodes.model.quant import Quant
    from tandem.nodes.prefill.kernels import dequant_triton
    from tandem.nodes.prefill.kernels.dequant import dequantize, work_dtype

    F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
    # (scales' dtype, output dtype): rounded in the scales' dtype, or widened to float32
    DTYPES = [(F32, F32), (BF16, BF16), (F16, F16), (F16, BF16), (BF16, F32), (F32, F16)]
    ROWS, COLS = 6, 384  # 384: a program's block of 512 values is a quarter masked off
    gen = torch.Generator().manual_seed(0)
    results = {}
    for bits, (sdtype, dtype) in itertools.product((2, 3, 4, 5, 6, 8), DTYPES):
        group = {2: 32, 3: 64, 4: 128, 5: 32, 6: 64, 8: 128}[bits]
        words = torch.randint(-(2**31), 2**31, (ROWS, COLS * bits // 32), generator=gen,
                              dtype=torch.int64).to(torch.int32)
        shape = (ROWS, COLS // group)
        # scales across a wide range: products that round, some below half precision's normals
        scales = (torch.randn(shape, generator=gen) * 10 ** torch.randint(-6, 2, shape,
                  generator=gen)).to(sdtype)
        biases = (torch.randn(shape, generator=gen) * 3).to(sdtype)
        want = dequantize(words, scales, biases, Quant(bits, group), dtype)
        # rows apart in memory: the kernel takes the row strides
        out = torch.full((ROWS, COLS + 32), float("nan"), dtype=dtype)[:, :COLS]
        got = dequant_triton.dequantize_affine(
            words, scales, biases, bits, group, out, work_dtype(sdtype, dtype))
        same = got.view(torch.uint8 if dtype.itemsize == 1 else {2: torch.int16,
                        4: torch.int32}[dtype.itemsize])
        ref = want.view(same.dtype)
        results[f"{bits}bit {sdtype}->{dtype}"] = {
            "equal": bool(torch.equal(same, ref)),
            "differ": int((same != ref).sum()),
            "rounds": bool((want != want.float().round()).any()),
        }
    print(json.dumps(results))
    """
)


def test_the_cpu_path_never_imports_triton() -> None:
    """A node without triton works as before: `dequant` imports it only for CUDA tensors."""
    code = (
        "import sys, torch\n"
        "from tandem.nodes.model.quant import Quant\n"
        "from tandem.nodes.prefill.kernels.dequant import dequantize\n"
        "w = torch.zeros((2, 12), dtype=torch.int32)\n"
        "s = torch.ones((2, 2), dtype=torch.bfloat16)\n"
        "dequantize(w, s, s, Quant(3, 64), torch.bfloat16)\n"
        "assert 'triton' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_triton
def test_the_triton_kernel_is_the_torch_path_bit_for_bit() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 6 * 6
    wrong = {case: r["differ"] for case, r in results.items() if not r["equal"]}
    assert not wrong, f"values that differ from the torch path: {wrong}"
    assert all(r["rounds"] for r in results.values())  # the cases exercise rounding


SIGNATURE = {
    "words": "*u8", "cols": "i32", "words_row": "i32", "scales_row": "i32", "biases_row": "i32",
    "out_row": "i32", "BITS": "constexpr", "GROUP": "constexpr", "NARROW": "constexpr",
    "BLOCK": "constexpr",
}  # fmt: skip


@needs_triton
@pytest.mark.parametrize("capability", [75, 80, 90])
def test_the_kernel_compiles_for_cuda_without_fused_multiply_adds(capability: int) -> None:
    """Built for a card that is not here (Triton ships its own ptxas): every width, the
    float32 path's product and sum stay two roundings (an FMA would make them one)."""
    import triton
    from tandem.nodes.prefill.kernels import dequant_triton as dt
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # (scales, output, NARROW): rounded in bfloat16; widened to float32 for a bfloat16 output
    for bits, (sdtype, dtype, narrow) in zip(
        (2, 3, 4, 5, 6, 8), [("bf16", "bf16", True), ("fp16", "bf16", False)] * 3, strict=True
    ):
        signature = SIGNATURE | {"scales": f"*{sdtype}", "biases": f"*{sdtype}", "out": f"*{dtype}"}
        constants = {"BITS": bits, "GROUP": 64, "NARROW": narrow, "BLOCK": dt.BLOCK}
        source = ASTSource(dt._affine, signature, constexprs=constants)
        kernel = triton.compile(
            source, target=GPUTarget("cuda", capability, 32), options=dt.OPTIONS
        )
        ptx = kernel.asm["ptx"]
        assert "fma" not in ptx and kernel.asm["cubin"], (bits, sdtype, dtype)


@needs_triton
@pytest.mark.cuda
@pytest.mark.parametrize("bits", [3, 4, 6])
def test_on_cuda_dequantize_takes_the_kernel_and_gives_the_torch_paths_bits(bits: int) -> None:
    import torch
    from tandem.nodes.model.quant import Quant
    from tandem.nodes.prefill.kernels import dequant

    gen = torch.Generator().manual_seed(bits)
    rows, cols = 256, 4096
    words = torch.randint(-(2**31), 2**31, (rows, cols * bits // 32), generator=gen)
    scales = torch.randn(rows, cols // 64, generator=gen).to(torch.bfloat16)
    biases = torch.randn(rows, cols // 64, generator=gen).to(torch.bfloat16)
    words, scales, biases = (t.cuda() for t in (words.to(torch.int32), scales, biases))
    quant = Quant(bits, 64)
    assert dequant._triton(words.device) is not None  # triton imports and runs here
    fast = dequant.dequantize(words, scales, biases, quant, torch.bfloat16)
    slow = dequant.dequantize(words, scales, biases, quant, torch.bfloat16, triton=False)
    assert torch.equal(fast.view(torch.int16), slow.view(torch.int16))
