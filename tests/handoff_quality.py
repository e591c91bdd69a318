"""Test helper. Handoff quality, teacher-forced: how well a handed-off prompt cache predicts a
fixed real continuation, against mlx-lm's own prefill of the same prompt on the same model.

For bf16 and quantized models greedy text is the wrong judge (torch and mlx round differently,
so near-tied logits flip; DESIGN.md): both caches read the same continuation instead, and we
compare the argmax at every position and the continuation's perplexity.

bf16 is judged as mlx-lm's own bf16 is (issue 45): over a long continuation, each position's
next-token distribution after the handed-off cache against the float32 model's own run of the
same text (mean KL divergence per token), beside the same for mlx-lm's own bf16 prefill. Over
~100 tokens bf16 rounding alone moves perplexity by about a percent either way, so a ratio of
perplexities between two bf16 runs is noise; the divergence from float32 is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families import family_for
from tandem.nodes.decode.families.base import LayerArrays
from tandem.nodes.decode.families.llama import fill_quantized
from tandem.nodes.model.spec import ModelSpec


@dataclass(frozen=True)
class Quality:
    """One continuation read after two caches of the same prompt."""

    tokens: int  # continuation tokens scored
    top1_agreement: float  # fraction of positions whose argmax agrees
    perplexity: float  # of the continuation after the handed-off cache
    reference_perplexity: float  # the same after mlx-lm's own prefill

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity


def read_continuation(
    model: Any, cache: list[Any], last_prompt_token: int, continuation: Sequence[int]
) -> tuple[list[float], list[int]]:
    """Feed `[t_{n-1}, c_0 .. c_{m-2}]` after `cache` (tokens 0..n-2): the log-probability of
    each `c_i` and the argmax at each position."""
    inputs = mx.array([[last_prompt_token, *continuation[:-1]]])
    logits = model(inputs, cache=cache)[0].astype(mx.float32)  # [m, V]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.array(list(continuation))
    picked = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    return picked.tolist(), mx.argmax(logits, axis=-1).tolist()


def continuation_logprobs(
    model: Any, cache: list[Any], last_prompt_token: int, continuation: Sequence[int]
) -> mx.array:
    """Feed `[t_{n-1}, c_0 .. c_{m-2}]` after `cache` (tokens 0..n-2): the next-token
    log-probabilities at each position, [m, V] float32."""
    inputs = mx.array([[last_prompt_token, *continuation[:-1]]])
    logits = model(inputs, cache=cache)[0].astype(mx.float32)  # [m, V]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return logprobs


@dataclass(frozen=True)
class Divergence:
    """A bf16 handoff and mlx-lm's own bf16 prefill of the same prompt, each reading the same
    continuation, against the float32 model's own run of it."""

    tokens: int  # continuation tokens scored
    kl: float  # mean per-token KL(float32 || handoff), nats
    reference_kl: float  # mean per-token KL(float32 || mlx-lm's own bf16), nats
    perplexity: float  # of the continuation after the handed-off cache
    float_perplexity: float  # the same in the float32 run
    reference_perplexity: float  # the same after mlx-lm's own bf16 prefill

    @property
    def kl_ratio(self) -> float:
        return self.kl / self.reference_kl

    @property
    def perplexity_ratio(self) -> float:
        """The handoff's perplexity over the float32 run's."""
        return self.perplexity / self.float_perplexity

    def __str__(self) -> str:
        return (
            f"over {self.tokens} tokens: mean KL from float32 {self.kl:.3e} vs mlx-lm's own "
            f"bf16 {self.reference_kl:.3e} ({self.kl_ratio:.3f}x); perplexity "
            f"{self.perplexity:.4f} vs float32 {self.float_perplexity:.4f} "
            f"({self.perplexity_ratio - 1:+.2%}), mlx-lm's bf16 {self.reference_perplexity:.4f} "
            f"({self.reference_perplexity / self.float_perplexity - 1:+.2%})"
        )


def bf16_divergence(
    float_model: Any,
    bf16_model: Any,
    handed_off: Callable[[], list[Any]],
    prompt: Sequence[int],
    continuation: Sequence[int],
) -> Divergence:
    """Score `continuation` after `handed_off()` (the bf16 model's cache of `prompt[:-1]`), after
    mlx-lm's own bf16 prefill and after the float32 model's own: the two bf16 runs' divergence
    from the float32 one. mlx-lm's two runs go on a thread of their own beside the handoff."""
    if len(prompt) < 2 or len(continuation) < 1:
        raise ValueError("need a prompt of at least 2 tokens and a continuation")

    def own(model: Any) -> mx.array:
        cache = own_prefill(model, prompt[:-1])
        return continuation_logprobs(model, cache, prompt[-1], continuation)

    def scores(logprobs: mx.array) -> tuple[float, float]:
        """(mean KL from the float32 run, perplexity of the continuation)."""
        kl = mx.sum(mx.exp(exact) * (exact - logprobs), axis=-1)  # [m]
        picked = mx.take_along_axis(logprobs, targets[:, None], axis=-1)
        return mx.mean(kl).item(), math.exp(-mx.mean(picked).item())

    with ThreadPoolExecutor(1, thread_name_prefix="mlx-reference") as pool:
        theirs = pool.submit(lambda: (own(float_model), own(bf16_model)))
        ours = continuation_logprobs(bf16_model, handed_off(), prompt[-1], continuation)
        exact, reference = theirs.result()
    targets = mx.array(list(continuation))
    kl, perplexity = scores(ours)
    reference_kl, reference_perplexity = scores(reference)
    return Divergence(
        tokens=len(continuation),
        kl=kl,
        reference_kl=reference_kl,
        perplexity=perplexity,
        float_perplexity=scores(exact)[1],
        reference_perplexity=reference_perplexity,
    )


def own_prefill(
    model: Any, prompt_head: Sequence[int], kv_format: KVFormat | None = None
) -> list[Any]:
    """mlx-lm's own cache of `prompt_head` (tokens 0..n-2), in generate's prefill steps,
    quantized as `generate(kv_bits=..., quantized_kv_start=0)` does when `kv_format` says."""
    cache = lm.new_caches(model)
    step = lm.PREFILL_STEP
    for start in range(0, len(prompt_head), step):
        model(mx.array([list(prompt_head[start : start + step])]), cache=cache)
        lm.quantize_when_due(cache, kv_format)
        lm.evaluate(cache)
    return cache


def from_quantized(layers: list[dict[str, mx.array]], kv_format: KVFormat) -> lm.Caches:
    """Quantized caches holding each layer's packed K and V (`Header.tensors` names), filled
    as the decode node fills them from frames."""
    caches = [
        fill_quantized(KVCache(), LayerArrays(i, parts, 0), kv_format)
        for i, parts in enumerate(layers)
    ]
    lm.evaluate(caches)
    return caches


def from_float(
    model: Any, spec: ModelSpec, layers: list[tuple[mx.array, mx.array]], end: int
) -> lm.Caches:
    """The model's own cache list (`RotatingKVCache` on sliding layers) holding each layer's
    float K, V [1, n_kv, end, D] of positions 0..end-1, filled by the decode family as the
    decode node fills them from frames: a sliding layer gets only the last positions its
    window keeps, which is all that crosses the wire."""
    family, caches = family_for(spec.family), lm.new_caches(model)
    for i, (kind, (k, v)) in enumerate(zip(spec.layer_kinds, layers, strict=True)):
        if kind.window is not None:
            k, v = k[..., -kind.window :, :], v[..., -kind.window :, :]
        caches[i] = family.fill(kind, caches[i], LayerArrays(i, {"k": k, "v": v}, end), None)
    lm.evaluate(caches)
    return caches


def handoff_quality(
    model: Any,
    handed_off: list[Any] | Callable[[], list[Any]],
    prompt: Sequence[int],
    continuation: Sequence[int],
    kv_format: KVFormat | None = None,
) -> Quality:
    """Score `continuation` after the handed-off cache (holding `prompt[:-1]`; or a callable
    that makes it) and after mlx-lm's own prefill of the same tokens (its own quantized cache
    for `kv_format`). mlx-lm's side runs on a thread of its own (each thread has its own mlx
    stream), beside the making and reading of the handed-off cache: on a CPU, two cores."""
    if len(prompt) < 2 or len(continuation) < 1:
        raise ValueError("need a prompt of at least 2 tokens and a continuation")

    def reference() -> tuple[list[float], list[int]]:
        cache = own_prefill(model, prompt[:-1], kv_format)
        return read_continuation(model, cache, prompt[-1], continuation)

    with ThreadPoolExecutor(1, thread_name_prefix="mlx-reference") as pool:
        theirs = pool.submit(reference)
        cache = handed_off() if callable(handed_off) else handed_off
        ours_lp, ours_top = read_continuation(model, cache, prompt[-1], continuation)
        ref_lp, ref_top = theirs.result()
    agree = sum(a == b for a, b in zip(ours_top, ref_top, strict=True)) / len(continuation)
    return Quality(
        tokens=len(continuation),
        top1_agreement=agree,
        perplexity=math.exp(-sum(ours_lp) / len(ours_lp)),
        reference_perplexity=math.exp(-sum(ref_lp) / len(ref_lp)),
    )
