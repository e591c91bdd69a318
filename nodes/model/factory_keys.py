"""The config.json keys every `tandem make-model` family writes alike (factory.py for the
dense, MoE and Gemma 3 families, factory_qwen3_5.py inside Qwen3.5's `text_config`)."""

from __future__ import annotations

from typing import Protocol


class DecoderArgs(Protocol):
    """The fields of `factory.MakeModelArgs` read here."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_position_embeddings: int


def decoder_keys(a: DecoderArgs, head_dim: int) -> dict[str, object]:
    """The decoder's widths, counts and norm as Hugging Face names them."""
    return {
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": a.vocab,
        "max_position_embeddings": a.max_position_embeddings,
    }
