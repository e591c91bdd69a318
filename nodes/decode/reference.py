"""mlx-lm's own decode speed at a given context: the denominator of `tandem bench e2e`'s
`decode_ratio`. Run as `python -m nodes.decode.reference MODEL TOKENS MAX_TOKENS`; prints one
JSON line `{"decode_tok_s", "tokens"}`.

The rate is the decode node's steady-state definition (`Generation.steady_tok_s`): tokens
after the second over the time from the second token to the last, taken as mlx-lm's
`stream_generate` hands each token out."""

from __future__ import annotations

import json
import random
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate


def decode_rate(model_dir: str, tokens: int, max_tokens: int) -> dict[str, float]:
    model, tokenizer = load(model_dir)
    vocab = model.args.vocab_size
    prompt = [random.Random(0).randrange(vocab) for _ in range(tokens)]
    times = [
        time.perf_counter()
        for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)
    ]  # one response per token; the last one carries the final token
    if len(times) < 3:
        raise SystemExit("need at least 3 decoded tokens to measure a rate")
    return {"decode_tok_s": (len(times) - 2) / (times[-1] - times[1]), "tokens": len(times)}


if __name__ == "__main__":
    print(json.dumps(decode_rate(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
