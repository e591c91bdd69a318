"""The model part of `tandem plan`: what the model is, and what its layers send on the wire
per kind (full layers per token, sliding ones at most their window, linear ones their state)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.app.cli.plan_kv import wire_kv
from tandem.nodes.model.index import ModelIndex


@dataclass(frozen=True)
class ModelSummary:
    name: str
    path: str
    layers: int
    dtype: str  # the compute dtype (safetensors spelling)
    bytes: int  # every tensor, embeddings and head included
    layer_bytes: int  # the decoder layers: what a pass streams, less the resident set
    kv_bytes_per_token: int  # K and V of one position over the full layers (model dtype)
    kv_window_bytes: int  # over the sliding layers, at most: bounded by their windows
    sliding_layers: int
    windows: list[int]  # the sliding layers' windows (positions), each once
    experts: tuple[int, int] | None = None  # a mixture of experts: (experts, top-k)
    kv_state_bytes: int = 0  # over the linear layers: their state, the same for any prompt
    linear_layers: int = 0


def model_summary(index: ModelIndex) -> ModelSummary:
    """The model as `tandem plan` reports it; its wire bytes at 16 bits (the model's dtype)."""
    spec, kv = index.spec, wire_kv(index)
    return ModelSummary(
        name=spec.name,
        path=str(spec.path),
        layers=spec.num_layers,
        dtype=index.dtype,
        bytes=index.total_bytes,
        layer_bytes=sum(index.layer_bytes(i) for i in range(spec.num_layers)),
        kv_bytes_per_token=kv.full_per_token,
        kv_window_bytes=kv.window_bytes,
        sliding_layers=kv.sliding_layers,
        windows=sorted({w for w in kv.windows if w is not None}),
        experts=(spec.moe.num_experts, spec.moe.experts_per_token) if spec.moe else None,
        kv_state_bytes=kv.state_bytes,
        linear_layers=sum(k.kind == "linear" for k in spec.layer_kinds),
    )
