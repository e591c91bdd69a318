"""Decode families, one file per family; a model's `model_type` picks one here.

Adding a family: its file (a `DecodeFamily` subclass, or the dense family's in `llama.py`
where it has full-attention layers), its `model_type` in the model spec's parser
(`nodes/model/spec.py`), and one line below. A type without a line gets the generic family:
full-attention layers filled, the last token's step run whole.
"""

from __future__ import annotations

from tandem.nodes.decode.families.base import DecodeFamily
from tandem.nodes.decode.families.deepseek_v3 import DeepseekV3Family
from tandem.nodes.decode.families.gemma3 import Gemma3Family
from tandem.nodes.decode.families.gpt_oss import GptOssFamily
from tandem.nodes.decode.families.llama import DenseFamily, GenericFamily
from tandem.nodes.decode.families.qwen3_5 import Qwen35Family

FAMILIES: dict[str, DecodeFamily] = {
    "llama": DenseFamily(),
    "mistral": DenseFamily(),
    "qwen2": DenseFamily(),
    "qwen3": DenseFamily(),
    "qwen3_moe": DenseFamily(),  # mlx-lm's Model has the dense structure; its MLP routes
    "gemma3_text": Gemma3Family(),
    "qwen3_5": Qwen35Family(),
    "qwen3_5_moe": Qwen35Family(),  # the same layers; mlx-lm's MLP routes
    "gpt_oss": GptOssFamily(),
    "glm4_moe": DenseFamily(),  # mlx-lm's Model has the dense structure; its MLP routes
    "deepseek_v3": DeepseekV3Family(),
}


def family_for(model_type: str) -> DecodeFamily:
    """The decode family of a model type (the generic family for a type not listed)."""
    return FAMILIES.get(model_type) or GenericFamily()
