"""`tandem prefill --out` for every family (issue 45): the file holds each layer's cache in the
class mlx-lm's own `make_cache()` gives it (a `RotatingKVCache` for a window, with its offset
and rotation; an `ArraysCache` for a linear layer's state; a `QuantizedKVCache` for
`--kv-bits`), `load_prompt_cache` reads it, each layer's state is within 1e-4 of mlx-lm's
own prefill, and mlx-lm's greedy continuation from the file equals its own (float32).
`mlx_lm.generate --prompt-cache-file` reads it too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

from tests.conftest import MakeTiny

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 40  # tokens: five windows of the Gemma 3 model's 8, so its sliding caches rotate
CONTINUE = 12  # greedy tokens compared
# name → (make-model arguments, extra `tandem prefill` arguments)
CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "gemma3": ({"arch": "gemma3", "layers": 6, "sliding_window": 8, "head_dim": 32}, []),
    "qwen3_5": ({"arch": "qwen3_5", "layers": 4}, []),
    "qwen3_5_moe": ({"arch": "qwen3_5_moe", "layers": 4}, []),
    "llama_kv8": (
        {"arch": "llama", "layers": 4, "head_dim": 32},
        ["--kv-bits", "8", "--kv-group-size", "32"],
    ),
    "gemma3_kv8": (
        {"arch": "gemma3", "layers": 6, "sliding_window": 8, "head_dim": 32},
        ["--kv-bits", "8", "--kv-group-size", "32"],
    ),
}


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


@pytest.fixture(scope="module")
def written(
    tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path, list[int]]]:
    """Every case's `tandem prefill --out` of its prompt's tokens 0..n-2, run at once (each
    process pays for importing torch): name → (model dir, cache file, whole prompt)."""
    procs = {}
    for seed, (name, (model, extra)) in enumerate(CASES.items()):
        model_dir, tmp = tiny_model(**model), tmp_path_factory.mktemp(name)
        tokens = _tokens(seed, PROMPT)
        (tmp / "head.json").write_text(json.dumps(tokens[:-1]))
        out = tmp / "cache.safetensors"
        args = [
            sys.executable, "-m", "tandem.app", "prefill", "--model", str(model_dir),
            "--tokens-file", str(tmp / "head.json"), "--out", str(out), "--device", "cpu",
            "--chunk-tokens", "16", *extra,
        ]  # fmt: skip
        proc = subprocess.Popen(args, cwd=ROOT, text=True, stderr=subprocess.PIPE)
        procs[name] = (proc, model_dir, out, tokens)
    runs = {}
    for name, (proc, model_dir, out, tokens) in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name}: {stderr}"
        runs[name] = (model_dir, out, tokens)
    return runs


def _greedy(model: Any, cache: list[Any], prompt: list[int], **kwargs: Any) -> list[int]:
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=CONTINUE,
                          **kwargs)  # fmt: skip
    return [int(t) for t, _ in steps]


def _arrays(cache: Any) -> list[np.ndarray]:
    """A cache's arrays as mlx-lm holds them in use: a window's in position order, a full
    layer's up to its offset."""
    name = type(cache).__name__
    if name == "ArraysCache":
        return [np.array(a) for a in cache.cache]
    if name == "RotatingKVCache":
        keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        w = min(cache.max_size, keys.shape[2])
        return [np.array(keys[..., -w:, :]), np.array(values[..., -w:, :])]
    return [np.array(x[..., : cache.offset, :]) for x in (cache.keys, cache.values)]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5", "qwen3_5_moe"])
def test_each_layer_kind_is_written_as_mlx_lms_own_cache_and_continues_exactly(
    name: str, written: dict[str, tuple[Path, Path, list[int]]]
) -> None:
    model_dir, out, tokens = written[name]
    model, _ = load(str(model_dir))
    ours, about = load_prompt_cache(str(out), return_metadata=True)
    assert about["model"] == str(model_dir.resolve())
    theirs = make_prompt_cache(model)
    model(mx.array([tokens[:-1]]), cache=theirs)
    assert [type(c).__name__ for c in ours] == [type(c).__name__ for c in theirs]
    assert {type(c).__name__ for c in ours} - {"KVCache"}, "the model has another layer kind"
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if hasattr(b, "offset"):  # a linear layer's state has none
            assert a.offset == b.offset == PROMPT - 1, i
        for x, y in zip(_arrays(a), _arrays(b), strict=True):
            assert x.shape == y.shape, (i, x.shape, y.shape)
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4, err_msg=f"layer {i}")
    want = _greedy(model, make_prompt_cache(model), tokens)
    assert _greedy(model, ours, tokens[-1:]) == want


@pytest.mark.parametrize("name", ["llama_kv8", "gemma3_kv8"])
def test_kv_bits_write_quantized_caches_for_full_layers(
    name: str, written: dict[str, tuple[Path, Path, list[int]]]
) -> None:
    """Full layers as `QuantizedKVCache`s (8 bits, groups of 32) holding what mlx-lm's own
    quantizing of the same positions holds; windows stay float (mlx-lm cannot quantize a
    `RotatingKVCache`). mlx-lm continues from the file."""
    model_dir, out, tokens = written[name]
    model, _ = load(str(model_dir))
    ours = load_prompt_cache(str(out))
    theirs = make_prompt_cache(model)
    model(mx.array([tokens[:-1]]), cache=theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if type(b).__name__ != "KVCache":
            assert type(a) is type(b), i
            continue
        assert type(a).__name__ == "QuantizedKVCache", i
        assert (a.bits, a.group_size, a.offset) == (8, 32, PROMPT - 1)
        for packed, x in ((a.keys, b.keys), (a.values, b.values)):
            got = mx.dequantize(*packed, group_size=32, bits=8)[..., : a.offset, :]
            want = x[..., : a.offset, :]
            step = mx.max(mx.abs(want)).item() / 127  # one 8-bit step of the widest group
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=step)
    assert len(_greedy(model, ours, tokens[-1:])) == CONTINUE


def test_mlx_lm_generate_reads_the_file(written: dict[str, tuple[Path, Path, list[int]]]) -> None:
    """`mlx_lm.generate --prompt-cache-file` (the model named in the file) continues a Gemma 3
    prefill as mlx-lm's own generation of the same tokens does."""
    model_dir, out, tokens = written["gemma3"]
    model, tokenizer = load(str(model_dir))
    suffix = "ab"
    ids = tokenizer.encode(suffix, add_special_tokens=False)
    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file", str(out),
         "--prompt", suffix, "--max-tokens", str(CONTINUE), "--ignore-chat-template",
         "--verbose", "False"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    want = _greedy(model, make_prompt_cache(model), tokens[:-1] + ids)
    assert done.stdout.strip() == tokenizer.decode(want).strip()
