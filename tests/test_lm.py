"""nodes/decode/lm.py (the one module that reaches into mlx-lm) and the token loop over it
(generate.py), against mlx-lm itself: the token loop, its cache copies and its quantized-cache
appends give the same token stream as `mlx_lm.stream_generate` on the same cache (greedy,
float32). An mlx-lm upgrade that moves a
cache's `state` or the loop's op order fails here first."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import generate, lm
from tandem.nodes.decode.families.base import LayerArrays
from tandem.nodes.decode.families.llama import fill_quantized
from tandem.nodes.decode.reference import reference_tokens

from tests.conftest import MakeTiny

PROMPT = [(11 * i + 5) % 500 for i in range(40)]


@pytest.fixture(scope="module")
def loaded(tiny_model: MakeTiny) -> tuple[Any, Any]:
    return lm.load(tiny_model(arch="llama", layers=2, head_dim=64))


def _greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def _prefilled(model: Any) -> lm.Caches:
    caches = lm.new_caches(model)
    lm.prefill(model, mx.array(PROMPT), caches)  # all but the last token
    return caches


def _theirs(model: Any, tokenizer: Any, caches: lm.Caches, n: int) -> list[int]:
    return list(reference_tokens(model, tokenizer, PROMPT[-1:], n, caches))


def _ours(model: Any, caches: lm.Caches, n: int, fmt: KVFormat | None = None) -> list[int]:
    return [s.token for s in generate.steps(model, mx.array(PROMPT[-1:]), caches, _greedy, n, fmt)]


def _until_eos(tokens: list[int], tokenizer: Any) -> list[int]:
    """mlx-lm's stream reports an eos and stops; so does ours."""
    eos = set(tokenizer.eos_token_ids)
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


@pytest.mark.parametrize("n", [1, 2, 5, 12])
def test_token_steps_equal_stream_generate_on_a_copied_cache(loaded: Any, n: int) -> None:
    model, tokenizer = loaded
    caches = _prefilled(model)
    assert lm.positions(caches) == len(PROMPT) - 1
    copy = lm.clone_prefix(caches, lm.positions(caches))  # through `state` and a fresh cache
    want = _theirs(model, tokenizer, caches, n)
    assert _until_eos(_ours(model, copy, n), tokenizer) == want


def test_a_cache_cut_shorter_decodes_as_mlx_lm_after_the_same_prefix(loaded: Any) -> None:
    model, tokenizer = loaded
    caches = _prefilled(model)
    lm.trim_to(caches, 20)
    copy = lm.clone_prefix(caches, 20)
    assert lm.positions(copy) == 20
    want = list(reference_tokens(model, tokenizer, PROMPT[20:], 6, caches))
    got = [s.token for s in generate.steps(model, mx.array(PROMPT[20:]), copy, _greedy, 6)]
    assert _until_eos(got, tokenizer) == want


@pytest.mark.parametrize("bits", [8, 4])
def test_appended_quantized_positions_decode_as_mlx_lms_own_quantized_cache(
    loaded: Any, bits: int
) -> None:
    """A quantized cache filled by `append_quantized` (two appends, as two turns' frames) is
    the cache mlx-lm's `to_quantized` makes of the same positions."""
    model, tokenizer = loaded
    fmt = KVFormat(bits, 64)
    theirs = [lm.to_quantized(c, fmt) for c in _prefilled(model)]
    ours = [lm.to_quantized(c, fmt) for c in lm.new_caches(model)]  # empty, quantized
    for layer, (mine, src) in enumerate(zip(ours, theirs, strict=True)):
        keys, values = src.state[:2]
        for lo, hi in ((0, 25), (25, len(PROMPT) - 1)):
            parts = {
                name: x[..., lo:hi, :]
                for prefix, arrays in (("k", keys), ("v", values))
                for name, x in zip(
                    (prefix, f"{prefix}_scales", f"{prefix}_biases"), arrays, strict=True
                )
            }
            assert fill_quantized(mine, LayerArrays(layer, parts, 0), fmt) is mine
    lm.evaluate(ours)
    assert [lm.size(c) for c in ours] == [lm.size(c) for c in theirs]
    want = _theirs(model, tokenizer, theirs, 8)
    assert _until_eos(_ours(model, ours, 8, fmt), tokenizer) == want


def test_each_layers_cache_kind(loaded: Any) -> None:
    model, _ = loaded
    caches = lm.new_caches(model)
    assert [lm.kind(c) for c in caches] == ["full", "full"]
    assert lm.kind(lm.to_quantized(caches[0], KVFormat(8, 64))) == "full"
    assert lm.quantized_form(lm.to_quantized(caches[0], KVFormat(4, 32))) == (4, 32)


def test_only_lm_imports_mlx_lm_on_the_request_path() -> None:
    """The decode node's request path reaches mlx-lm through lm.py alone. Exempt, each a
    boundary of its own: the decode group's ranks (`group/`: mlx-lm's loader and pipeline
    per rank) and `reference.py` (the bench's plain mlx-lm generation, side by side)."""
    import ast
    from pathlib import Path

    root = Path(lm.__file__).parent
    exempt = {root / "lm.py", root / "reference.py"}
    importers = []
    for path in sorted(root.rglob("*.py")):
        if path in exempt or "group" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "mlx_lm" or n.startswith("mlx_lm.") for n in names):
                importers.append(path.relative_to(root).as_posix())
    assert importers == []


def test_a_tiny_temperature_is_greedy() -> None:
    """Issue 47 item 8: logits over 1e-300 overflow to infinities, and sampled at random."""
    from tandem.nodes.decode import lm

    logprobs = mx.array([[-3.0, -0.5, -1.0, -4.0, -2.0]])
    for temperature in (1e-300, 1e-9, 0.0):
        sample = lm.sampler(temperature, 1.0)
        assert {int(sample(logprobs).item()) for _ in range(20)} == {1}
