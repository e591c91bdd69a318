"""The dense family (Llama, Mistral, Qwen2, Qwen3): every layer full attention, the model
`model.model` = embed_tokens → layers → norm, then `lm_head` (or the tied embedding).

It fills full-attention layers (every family's: Gemma 3's and Qwen3.5's families extend this
one), and its stepper runs the prompt's last token through the model one layer at a time, as
a remote prefill's layers land, so that the first token is sampled the moment the last layer is in.
Layer i of that pass needs only layer i's cache, so it runs as soon as frame i is in (on the
mlx thread, between frames); what remains when the last frame lands is one layer, the final
norm and the head, not a whole decode step. On mlx's CPU backend with a quantized cache that
step alone was a fifth of the time to first token.

The ops are the model's own modules in the model's own order — mlx-lm's `Model.__call__` on
one token, cut between layers — so the logits are the same bits as `model(token, cache)`.
A model whose structure is not this one (sliding-window layers, other wrappers) gets no
stepper, and the decode node runs the step whole; so does a model type no family lists
(`GenericFamily`: its full-attention layers filled as here).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.decode import lm
from tandem.nodes.decode.families.base import DecodeFamily, LayerArrays, LayerStepper
from tandem.nodes.model.spec import LayerKind


class DenseFamily(DecodeFamily):
    name = "dense"

    def fill(
        self, kind: LayerKind, cache: Any, arrays: LayerArrays, kv_format: KVFormat | None
    ) -> Any:
        if kind.kind != "full" or lm.kind(cache) != "full":
            return super().fill(kind, cache, arrays, kv_format)
        if kv_format is None:
            t = arrays.tensors
            lm.append(cache, t["k"], t["v"])
            return cache
        return fill_quantized(cache, arrays, kv_format)

    def stepper(self, model: Any, token: int, caches: lm.Caches) -> LayerStepper | None:
        return FirstStep.for_model(model, token, caches)


class GenericFamily(DenseFamily):
    """A model type no family lists: its full-attention layers filled, its last prompt
    token's step run whole (its model may scale or cap what the dense structure does not)."""

    name = "generic"

    def stepper(self, model: Any, token: int, caches: lm.Caches) -> LayerStepper | None:
        return None


def fill_quantized(cache: Any, arrays: LayerArrays, kv_format: KVFormat) -> Any:
    """A full-attention layer's quantized positions appended; its float prefix (if any)
    quantized first, as mlx-lm would have."""
    cache = lm.to_quantized(cache, kv_format)
    if lm.quantized_form(cache) != (kv_format.bits, kv_format.group_size):
        raise ProtocolError(f"layer {arrays.layer}: the cache is quantized otherwise")
    t = arrays.tensors
    lm.append_quantized(
        cache, (t["k"], t["k_scales"], t["k_biases"]), (t["v"], t["v_scales"], t["v_biases"])
    )
    return cache


class FirstStep:
    """`Model.__call__(token[None], caches)` cut between layers."""

    def __init__(self, model: Any, token: int, caches: lm.Caches) -> None:
        self.token = token
        self.model, self.inner, self.caches = model, model.model, caches
        self.layers = _layers(self.inner)
        with mx.stream(lm.STREAM):
            self.h = self.inner.embed_tokens(mx.array([[token]]))  # [1, 1, hidden]
        self.mask: Any = None
        self.layers_done = 0

    @classmethod
    def for_model(cls, model: Any, token: int, caches: lm.Caches) -> FirstStep | None:
        """A layer-at-a-time pass of `token` after `caches`, or None where `model`'s
        structure is not the one known here."""
        inner = getattr(model, "model", None)
        layers = _layers(inner)
        known = (
            layers is not None
            and len(layers) == len(caches)
            and getattr(inner, "pipeline_size", 1) == 1
            and all(hasattr(inner, a) for a in ("embed_tokens", "norm"))
            and not any(getattr(layer, "use_sliding", False) for layer in layers)
            and (_tied(model) or hasattr(model, "lm_head"))
        )
        return cls(model, token, caches) if known else None

    def advance(self, layer: int) -> None:
        """On the mlx thread, once layer `layer`'s cache holds the prompt: run that layer."""
        if layer != self.layers_done:
            raise ValueError(f"layer {layer} before layer {self.layers_done}")
        with mx.stream(lm.STREAM):
            if layer == 0:  # as the model makes it: from the first layer's cache
                self.mask = lm.attention_mask(self.h, self.caches[0])
            self.h = self.layers[layer](self.h, self.mask, cache=self.caches[layer])
        mx.eval(self.h)  # now, while the next frame is still on the wire
        self.layers_done += 1

    @property
    def complete(self) -> bool:
        return self.layers_done == len(self.caches)

    def logits(self) -> mx.array:
        """[1, vocab]: the last prompt token's logits (every layer advanced)."""
        if not self.complete:
            raise ValueError(f"{self.layers_done} of {len(self.caches)} layers advanced")
        out = self.inner.norm(self.h)
        head = self.inner.embed_tokens.as_linear if _tied(self.model) else self.model.lm_head
        return head(out)[:, -1, :]


def _layers(inner: Any) -> list[Any] | None:
    """The blocks the model runs, in order (Qwen2 names them `pipeline_layers`)."""
    layers = getattr(inner, "pipeline_layers", None)
    return layers if layers is not None else getattr(inner, "layers", None)


def _tied(model: Any) -> bool:
    args = getattr(model, "args", None)
    return bool(getattr(args, "tie_word_embeddings", False))
