"""The tool a user would pick instead: transformers + accelerate offload at the same memory
budget. Run in its own process by `tandem bench prefill --vs accelerate`; prints one JSON line
`{"wall_s", "peak_rss_delta_bytes", "load_s"}` (wall: the prefill forward pass only)."""

from __future__ import annotations

import json
import sys
import tempfile
import time

import numpy as np
import torch


def main(model: str, tokens: int, budget: int, device: str) -> dict[str, float]:
    from tandem.nodes.prefill.measure.bench import _peak_rss, _reset_peak_rss, _rss
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="tandem-offload-") as offload:
        t0 = time.perf_counter()
        base = _rss()
        _reset_peak_rss()
        lm = AutoModelForCausalLM.from_pretrained(
            model,
            dtype=getattr(config, "torch_dtype", None) or torch.bfloat16,
            device_map="auto",
            max_memory={0 if dev == "cuda" else "cpu": budget},
            offload_folder=offload,
            offload_state_dict=True,
        )
        load_s = time.perf_counter() - t0
        ids = np.random.default_rng(0).integers(0, config.vocab_size, tokens)
        inputs = torch.tensor([ids.tolist()], device=dev)
        t1 = time.perf_counter()
        with torch.inference_mode():
            lm.model(inputs, use_cache=True)  # the prefill: K/V of every layer, no LM head
        wall_s = time.perf_counter() - t1
        peak = _peak_rss() - base
    return {"wall_s": wall_s, "peak_rss_delta_bytes": peak, "load_s": load_s}


if __name__ == "__main__":
    model, tokens, budget, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    print(json.dumps(main(model, tokens, budget, device)))
