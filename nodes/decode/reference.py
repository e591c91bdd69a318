"""mlx-lm's own decode speed at a given context: the denominator of `tandem bench e2e`'s
`decode_ratio`. Run as `python -m tandem.nodes.decode.reference MODEL TOKENS MAX_TOKENS [KV_BITS
KV_GROUP_SIZE]`; prints one JSON line `{"decode_tok_s", "tokens"}`. With KV_BITS, mlx-lm's own
quantized cache (`kv_bits`, `quantized_kv_start=0`).

The rate is the decode node's steady-state definition (`Generation.steady_tok_s`): tokens
after the second over the time from the second token to the last, taken as mlx-lm's
`stream_generate` hands each token out."""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm import stream_generate
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm


def reference_tokens(
    model: Any,
    tokenizer: Any,
    prompt: Sequence[int],
    max_tokens: int,
    caches: lm.Caches | None = None,
    kv_format: KVFormat | None = None,
) -> Iterator[int]:
    """mlx-lm's own `stream_generate` (greedy unless its defaults change), one token id per
    response: what this module's generation is checked against, and the bench's reference.
    With `kv_format`, mlx-lm quantizes its cache from the start (`quantized_kv_start=0`); a
    model with windows (which mlx-lm cannot quantize) generates over its mixed cache list
    built by hand: the prompt prefilled, then its full layers' caches quantized."""
    quant: dict[str, Any] = {"kv_bits": None}
    if kv_format is not None and any(lm.kind(c) != "full" for c in lm.new_caches(model)):
        caches = caches if caches is not None else lm.new_caches(model)
        prompt = lm.prefill(model, mx.array(list(prompt)), caches, kv_format).tolist()
    elif kv_format is not None:
        quant = {"kv_bits": kv_format.bits, "kv_group_size": kv_format.group_size,
                 "quantized_kv_start": 0}  # fmt: skip
    for response in stream_generate(
        model, tokenizer, mx.array(list(prompt)), max_tokens=max_tokens, prompt_cache=caches,
        **quant,
    ):  # fmt: skip
        yield response.token


def decode_rate(
    model_dir: str, tokens: int, max_tokens: int, kv_bits: int | None = None, kv_group: int = 64
) -> dict[str, float]:
    model, tokenizer = lm.load(model_dir)
    vocab = lm.vocab_size(model)
    prompt = [random.Random(0).randrange(vocab) for _ in range(tokens)]
    kv_format = KVFormat(kv_bits, kv_group) if kv_bits is not None else None
    times = [
        time.perf_counter()
        for _ in reference_tokens(model, tokenizer, prompt, max_tokens, kv_format=kv_format)
    ]  # one response per token; the last one carries the final token
    if len(times) < 3:
        raise SystemExit("need at least 3 decoded tokens to measure a rate")
    return {"decode_tok_s": (len(times) - 2) / (times[-1] - times[1]), "tokens": len(times)}


if __name__ == "__main__":
    bits = int(sys.argv[4]) if len(sys.argv) > 4 else None
    group = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    print(json.dumps(decode_rate(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), bits, group)))
