"""K/V bytes on the wire for a prompt: what `tandem plan` and the decode node's router count.

A full layer sends every position, so its bytes grow with the prompt; a sliding layer sends
at most its window (the positions its `RotatingKVCache` keeps), so its bytes stop growing
once the prompt passes the window; a latent layer (DeepSeek V3) its latent and rope key, one
of each a position whatever the heads, in the model's dtype; a linear layer sends no K/V but
its state, of a fixed size whatever the prompt (`state_tensors`: the conv state in the model's
dtype, the recurrent state in float32). Quantized K/V (`kv_bits` 8 or 4) applies to full
layers only: a sliding layer stays in the model's dtype (it is bounded, and mlx-lm cannot
quantize a `RotatingKVCache`). Frame headers are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import ModelSpec


class TokenBytes(Protocol):
    """A quantized K/V format (`nodes/contract/http.KVFormat`), as far as bytes go."""

    def bytes_per_token(self, layers: int, n_kv_heads: int, head_dim: int, itemsize: int) -> int:
        """K and V of one token over `layers` layers (bytes)."""
        ...


@dataclass(frozen=True)
class KVBytes:
    """Per layer: K and V bytes of one position, and how many positions it sends at most."""

    per_token: tuple[int, ...]  # bytes/position, one per layer
    windows: tuple[int | None, ...]  # positions sent at most, one per layer; None: all
    fixed: tuple[int, ...] = ()  # bytes whatever the prompt (a linear layer's state); (): 0

    @property
    def layers(self) -> int:
        return len(self.per_token)

    def layer(self, i: int, tokens: int) -> int:
        """Layer `i`'s bytes for a prompt of `tokens` positions."""
        window, fixed = self.windows[i], self.fixed[i] if self.fixed else 0
        return fixed + self.per_token[i] * (tokens if window is None else min(tokens, window))

    def at(self, tokens: int) -> int:
        """All layers' bytes for a prompt of `tokens` positions."""
        return sum(self.layer(i, tokens) for i in range(self.layers))

    @property
    def full_per_token(self) -> int:
        """Bytes per position over the full layers: the part that grows with the prompt."""
        return sum(b for b, w in zip(self.per_token, self.windows, strict=True) if w is None)

    @property
    def window_bytes(self) -> int:
        """Bytes over the sliding layers once the prompt fills their windows: their most."""
        return sum(b * w for b, w in zip(self.per_token, self.windows, strict=True) if w)

    @property
    def state_bytes(self) -> int:
        """Bytes over the linear layers: their state, the same for any prompt."""
        return sum(self.fixed)

    @property
    def sliding_layers(self) -> int:
        return sum(w is not None for w in self.windows)


def kv_bytes(
    spec: ModelSpec, kv_format: TokenBytes | None = None, itemsize: int | None = None
) -> KVBytes:
    """What each layer of `spec` sends: full layers in `kv_format` (None: the model's dtype
    at `itemsize` bytes, by default 4 for float32 and 2 otherwise), sliding layers in the
    model's dtype, linear layers nothing."""
    size = itemsize or (4 if spec.torch_dtype == "float32" else 2)
    dense = 2 * spec.num_kv_heads * spec.head_dim * size  # K and V, one layer, one position
    packed = (
        dense
        if kv_format is None
        else kv_format.bytes_per_token(1, spec.num_kv_heads, spec.head_dim, size)
    )
    latent = sum(latent_widths(spec)) * size  # a latent and a rope key a position, in float
    per_token = tuple(
        {"full": packed, "sliding": dense, "linear": 0, "latent": latent}[k.kind]
        for k in spec.layer_kinds
    )
    state = sum(nbytes(dtype, shape, size) for _, dtype, shape in state_tensors(spec, "model"))
    fixed = tuple(state if k.kind == "linear" else 0 for k in spec.layer_kinds)
    return KVBytes(per_token, tuple(k.window for k in spec.layer_kinds), fixed)


State = tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) each


def latent_widths(spec: ModelSpec) -> tuple[int, ...]:
    """What a latent layer of `spec` keeps a position (the KV header's `latent`): its latent's
    and its rope key's widths; () for a model without latent layers."""
    mla = spec.mla
    return () if mla is None else (mla.kv_lora_rank, mla.rope_dim)


def state_tensors(spec: ModelSpec, dtype: str) -> State:
    """What a linear layer of `spec` hands over (the KV header's `state`): the conv state
    [1, K-1, conv_dim] in `dtype` (the model's compute dtype, safetensors spelling), the
    recurrent state [1, Hv, Dv, Dk] in F32, as mlx-lm's `ArraysCache` holds them; () for a
    model without linear layers."""
    lin = spec.linear
    if lin is None:
        return ()
    return (
        ("conv", dtype, (1, lin.conv_kernel - 1, lin.conv_dim)),
        ("recurrent", "F32", (1, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim)),
    )


def nbytes(dtype: str, shape: tuple[int, ...], model_itemsize: int) -> int:
    """A tensor's bytes: `dtype` a safetensors name, or "model" (the model's dtype, of
    `model_itemsize` bytes a value)."""
    itemsize = model_itemsize if dtype == "model" else ITEMSIZE[dtype]
    return itemsize * math.prod(shape)
