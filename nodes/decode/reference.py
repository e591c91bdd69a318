"""mlx-lm's own decode speed at a given context: the denominator of `tandem bench e2e`'s
`decode_ratio`. Run as `python -m nodes.decode.reference MODEL TOKENS MAX_TOKENS`; prints one
JSON line `{"decode_tok_s", "tokens"}`."""

from __future__ import annotations

import json
import random
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate


def decode_rate(model_dir: str, tokens: int, max_tokens: int) -> dict[str, float]:
    model, tokenizer = load(model_dir)
    vocab = model.args.vocab_size
    prompt = [random.Random(0).randrange(vocab) for _ in range(tokens)]
    responses = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)
    *_, last = responses  # the final response carries the whole run's rate
    return {"decode_tok_s": last.generation_tps, "tokens": last.generation_tokens}


if __name__ == "__main__":
    print(json.dumps(decode_rate(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
