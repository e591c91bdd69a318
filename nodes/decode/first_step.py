"""The prompt's last token through the model one layer at a time, as a remote prefill's layers
land, so that the first token is sampled the moment the last layer is in.

After a remote prefill the decode node still owes one forward pass: the last prompt token,
whose logits give the first token. Layer i of that pass needs only layer i's cache, so it
runs as soon as frame i is in (on the mlx thread, between frames); what remains when the
last frame lands is one layer, the final norm and the head, not a whole decode step. On
mlx's CPU backend with a quantized cache that step alone was a fifth of the time to first
token.

The ops are the model's own modules in the model's own order — `Model.__call__` on one
token, cut between layers — so the logits are the same bits as `model(token, cache)`. Models
whose structure this does not know (sliding-window layers, other wrappers) get no
`FirstStep`, and the decode node runs the step whole, as before.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.base import create_attention_mask
from tandem.nodes.decode import kv


class FirstStep:
    def __init__(self, model: Any, token: int, caches: kv.Caches) -> None:
        self.model, self.inner, self.caches = model, model.model, caches
        self.layers = _layers(self.inner)
        with mx.stream(generation_stream):
            self.h = self.inner.embed_tokens(mx.array([[token]]))  # [1, 1, hidden]
        self.mask: Any = None
        self.layers_done = 0

    @classmethod
    def for_model(cls, model: Any, token: int, caches: kv.Caches) -> FirstStep | None:
        """A first step for `model`, or None where its structure is not the one known here."""
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
        with mx.stream(generation_stream):
            if layer == 0:  # as the model makes it: from the first layer's cache
                self.mask = create_attention_mask(self.h, self.caches[0])
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
