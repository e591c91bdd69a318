"""Prefill families, one file per family; a model's `model_type` picks one here.

Adding a family: its file (a `PrefillFamily` subclass), its `model_type` in the model spec's
parser (`nodes/model/spec.py`), and one line below; its decode side is the same in
`nodes/decode/families/`.
"""

from __future__ import annotations

from tandem.nodes.prefill.errors import PrefillError
from tandem.nodes.prefill.families.base import Pass, PrefillFamily
from tandem.nodes.prefill.families.deepseek_v3 import DeepseekV3Family
from tandem.nodes.prefill.families.gemma3 import Gemma3Family
from tandem.nodes.prefill.families.glm4_moe import Glm4MoeFamily
from tandem.nodes.prefill.families.gpt_oss import GptOssFamily
from tandem.nodes.prefill.families.llama import DenseFamily
from tandem.nodes.prefill.families.qwen3_5 import Qwen35Family
from tandem.nodes.prefill.families.qwen3_moe import Qwen3MoeFamily

FAMILIES: dict[str, PrefillFamily] = {
    "llama": DenseFamily(),
    "mistral": DenseFamily(),
    "qwen2": DenseFamily(),
    "qwen3": DenseFamily(),
    "gemma3_text": Gemma3Family(),
    "qwen3_moe": Qwen3MoeFamily(),
    "qwen3_5": Qwen35Family(),
    "qwen3_5_moe": Qwen35Family(),
    "gpt_oss": GptOssFamily(),
    "glm4_moe": Glm4MoeFamily(),
    "deepseek_v3": DeepseekV3Family(),
}

__all__ = ["FAMILIES", "Pass", "PrefillFamily", "family_for"]


def family_for(model_type: str) -> PrefillFamily:
    """The prefill family of a model type; a PrefillError for a type no family serves."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise PrefillError(f"no prefill family for model type {model_type!r}")
    return family
