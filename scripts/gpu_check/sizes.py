"""What the check runs on: its models' shapes and token counts, full size on CUDA and
tiny in the CPU smoke run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GiB = 2**30
Json = dict[str, Any]  # a section's report


@dataclass(frozen=True)
class Sizes:
    """What each section runs on (make_model keyword arguments for the models)."""

    h2d_bytes: int
    attn_model: Json
    attn_tokens: int
    kv_model: Json
    kv_tokens: int
    chunk: int
    big_model: Json  # the small-card and bench sections' model
    wide_model: Json  # the memory section's: a few layers at 70B's widths
    memory_tokens: tuple[int, ...]
    card_budget: int | None  # None: a third of the big model
    card_bytes: int
    card_tokens: int
    bench_tokens: int
    bench_repeat: int


CUDA_SIZES = Sizes(
    h2d_bytes=GiB,
    attn_model={"layers": 1, "hidden": 1024, "heads": 8, "kv_heads": 2, "intermediate": 256,
                "vocab": 512, "max_position_embeddings": 16384},
    attn_tokens=2048,
    kv_model={"layers": 6, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1408,
              "vocab": 1024, "shards": 2, "rope_scaling": "llama3"},
    kv_tokens=384,
    chunk=128,
    # Llama-3-8B layers, 16 of them: 7.0 GB bf16, more than the 6 GiB budget
    big_model={"layers": 16, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
               "vocab": 4096, "shards": 4, "max_position_embeddings": 16384},
    # Llama-3-70B layers, 2 of them: 3.5 GB bf16
    wide_model={"layers": 2, "hidden": 8192, "heads": 64, "kv_heads": 8, "intermediate": 28672,
                "vocab": 4096, "shards": 1, "max_position_embeddings": 16384},
    memory_tokens=(512, 2048, 8192),
    card_budget=6 * GiB,
    card_bytes=8 * GiB,
    card_tokens=8192,
    bench_tokens=4096,
    bench_repeat=2,
)  # fmt: skip
SMOKE_SIZES = Sizes(
    h2d_bytes=0,
    attn_model={"layers": 1, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 128,
                "vocab": 512},
    attn_tokens=64,
    kv_model={"layers": 8, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256,
              "vocab": 512, "shards": 2, "rope_scaling": "llama3"},
    kv_tokens=40,
    chunk=16,
    big_model={"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512,
               "vocab": 512, "shards": 2},
    wide_model={"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 2, "intermediate": 896,
                "vocab": 512, "shards": 1},
    memory_tokens=(32, 64, 128),
    card_budget=None,
    card_bytes=0,
    card_tokens=128,
    bench_tokens=64,
    bench_repeat=1,
)  # fmt: skip
