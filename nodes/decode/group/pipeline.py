"""A decode group's model: this rank's layers only, run as one stage of a pipeline over
`mx.distributed` (issue 38).

The split is mlx-lm's: rank 0 holds the last layers, rank size-1 the first. Every rank embeds
the tokens (only the first stage uses them), receives the hidden state from rank + 1, runs
its layers, sends the result to rank - 1, and the last stage's output is all-gathered so that
every rank computes the same logits. A family that has mlx-lm's own `pipeline()` (Qwen3.5,
DeepSeek, GLM-MoE, ...) uses it; the dense families (Llama, Mistral, Qwen2, Qwen3: an
embedding, decoder layers and a final norm) get the same stages from `_DenseStage`.

Each rank loads only its own layers: the model is read lazily (mlx-lm's `load_model(lazy=
True)`), the other ranks' layers are dropped before anything is evaluated, so their weights
are never read. The embedding, the final norm and the head are every rank's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer
from tandem.nodes.decode.group.split import RankShare, ranges, split_layers

DENSE_STAGES = ("llama", "mistral", "qwen3")  # an embedding, decoder layers, a final norm


class GroupError(Exception):
    """A model or a group that cannot run as a decode group; the message says why."""


@dataclass
class Stage:
    """This rank's part of the model: `model(inputs, cache)` as the whole model's call is,
    over this rank's layers (`layers`, their caches from `make_cache()`)."""

    model: Any  # mlx-lm's model, its other ranks' layers dropped
    group: Any  # mx.distributed.Group
    layers_range: tuple[int, int]  # [first, end)
    forward: Any  # (inputs [1, T], cache) -> logits [1, T, vocab]

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.forward(inputs, cache)

    @property
    def layers(self) -> list[Any]:
        """This rank's layers, in order (mlx-lm's `pipeline_layers` where it pipelines)."""
        return list(self.model.layers) if _own(self.model) else self.forward.layers

    def make_cache(self) -> list[Any]:
        """Caches for this rank's layers, as the model makes them for all of its own."""
        if _own(self.model):
            return make_prompt_cache(self.model)
        return make_prompt_cache(_LayersOnly(self.layers))

    @property
    def weight_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


class _LayersOnly:
    """What `make_prompt_cache` reads of a model without `make_cache()`: its layers."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers


def _own(model: Any) -> bool:
    """Whether mlx-lm pipelines this model itself."""
    return hasattr(getattr(model, "model", None), "pipeline")


def memory_bytes() -> int:
    """The memory this rank has for weights: the GPU's working set on a Mac, else the RAM."""
    if mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def group_memory(group: Any) -> list[int]:
    """Every rank's `memory_bytes()` (MiB resolution), in rank order."""
    mine = mx.array([memory_bytes() // 2**20], dtype=mx.int32)
    every = mx.distributed.all_gather(mine, group=group, stream=mx.cpu)
    return [int(m) * 2**20 for m in every.tolist()]


def load_stage(
    model_dir: str | Path, group: Any, split: Sequence[int] | None = None
) -> tuple[Stage, Any, list[RankShare]]:
    """(this rank's stage, the tokenizer, every rank's share) for the model at `model_dir`,
    its layers split by `split` (layer counts per rank) or by each rank's memory."""
    path = Path(model_dir)
    model, config = load_model(path, lazy=True, strict=False)
    rank = group.rank()
    mem = group_memory(group)
    layers = len(model.layers)
    split = list(split) if split is not None else split_layers(layers, mem)
    first, end = ranges(split)[rank]
    if _own(model):
        model.model.pipeline(group, split)
        forward = model.__call__
    else:
        forward = _DenseStage(model, group, first, end)
    mx.eval(model.parameters())
    stage = Stage(model, group, (first, end), forward)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return stage, tokenizer, _shares(group, stage, mem, ranges(split))


def _shares(
    group: Any, stage: Stage, mem: list[int], spans: list[tuple[int, int]]
) -> list[RankShare]:
    """Every rank's share: its host, its layers, the weight bytes it loaded (KiB
    resolution) and its memory."""
    mine = mx.array([stage.weight_bytes // 1024], dtype=mx.int32)
    loaded = mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()
    hosts = _hosts(group.size())
    return [
        RankShare(r, hosts[r], spans[r], int(loaded[r]) * 1024, mem[r]) for r in range(group.size())
    ]


def _hosts(size: int) -> list[str]:
    """Each rank's host as `mlx.launch` wrote it (`MLX_HOSTFILE`: one ["ip:port", ...] list
    per rank), or "rank N" where it wrote none."""
    try:
        entries = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())
        hosts = [str(e[0]).rsplit(":", 1)[0] for e in entries]
    except (KeyError, OSError, ValueError, TypeError, IndexError):
        hosts = []
    return hosts if len(hosts) == size else [f"rank {r}" for r in range(size)]


class _DenseStage:
    """A dense model's call (`embed_tokens` → decoder layers → `norm` → head) as one stage:
    layers [first, end) of it, the others dropped before the weights are read. It returns
    the last position's logits [1, 1, vocab], all its callers read."""

    def __init__(self, model: Any, group: Any, first: int, end: int) -> None:
        inner = getattr(model, "model", None)
        kind = getattr(model.args, "model_type", "")
        if kind not in DENSE_STAGES or inner is None:
            raise GroupError(
                f"a {kind or type(model).__module__} model cannot run as a decode group yet "
                f"(mlx-lm has no pipeline() for it, and tandem's stages serve "
                f"{', '.join(DENSE_STAGES)})"
            )
        self.model, self.inner, self.group = model, inner, group
        self.rank, self.size = group.rank(), group.size()
        inner.layers = list(inner.layers[:end])
        inner.layers[:first] = [None] * first  # never evaluated: never read
        self.layers = inner.layers[first:end]

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        cache = cache if cache is not None else [None] * len(self.layers)
        h = self.inner.embed_tokens(inputs)  # [1, T, H]
        mask = create_attention_mask(h, cache[0])
        rank, size, group = self.rank, self.size, self.group
        if rank < size - 1:  # from the stage before: the layers below this rank's
            h = mx.distributed.recv_like(h, rank + 1, group=group)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask, cache=c)
        if rank != 0:
            h = mx.distributed.send(h, rank - 1, group=group)
            if cache[-1] is not None:  # the send runs when the cache is evaluated
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        if size > 1:  # the last stage's output, on every rank
            h = mx.distributed.all_gather(h, group=group)[: h.shape[0]]
        # the last position's logits only: a prompt's others are never read (mlx-lm's own
        # prefill leaves them unevaluated; a group evaluates each call, and [T, vocab] of
        # them is the largest array a long prompt would make)
        h = self.inner.norm(h[:, -1:])
        if getattr(self.model.args, "tie_word_embeddings", False):
            return self.inner.embed_tokens.as_linear(h)
        return self.model.lm_head(h)
