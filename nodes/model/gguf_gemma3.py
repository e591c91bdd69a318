"""A Gemma 3 GGUF (llama.cpp's format: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) as HF float
checkpoints (`model_type: gemma3_text`), through transformers 5's own GGUF reader.

transformers dequantizes every tensor with the `gguf` package and undoes llama.cpp's Gemma
conventions (its norms stored as 1 + w). What it hands back needs three repairs before it is
a checkpoint every part of tandem (and mlx-lm) reads:
- The model carries a quantizer flag that refuses `save_pretrained`: its config is rebuilt
  without `quantization_config` and the dequantized state dict written from a fresh model.
- It writes `rope_theta: null` at the top level with per-type `rope_parameters`; mlx-lm reads
  the top level only, so both spellings are written (`rope_theta`, `rope_local_base_freq`),
  and `sliding_window_pattern`, which is all mlx-lm reads of the layer kinds.
- Tied embeddings: `lm_head.weight` is the embedding, stored once.

torch and transformers are imported inside the functions (a preparation command; DESIGN.md).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tandem.nodes.model.errors import ModelError

log = logging.getLogger(__name__)
FloatDtype = Literal["float32", "bfloat16"]
# what transformers 5 writes into tokenizer_config.json for its own bookkeeping
_TOKENIZER_BOOKKEEPING = ("backend", "is_local", "local_files_only")
# config keys that say nothing about the model: the quantizer, where it was read, generic
# PretrainedConfig defaults (heads for classification, output flags)
_NOT_THE_MODEL = (
    "quantization_config", "_name_or_path", "_model_name_or_path", "dtype", "id2label",
    "label2id", "problem_type", "return_dict", "output_attentions", "output_hidden_states",
    "chunk_size_feed_forward", "is_encoder_decoder", "_sliding_window_pattern",
)  # fmt: skip


@dataclass(frozen=True)
class Gemma3Gguf:
    """A Gemma 3 GGUF read once: its float32 weights by HF name, HF config, and tokenizer."""

    source: Path
    config: dict[str, Any]
    state: dict[str, Any]  # HF name → float32 torch tensor; no lm_head (tied)
    tokenizer: Any  # a transformers tokenizer


def _config(hf_config: Any, where: Path) -> dict[str, Any]:
    """The config as a plain dict, quantizer gone and RoPE thetas written both ways."""
    config = hf_config.to_dict()
    if config.get("model_type") != "gemma3_text":
        raise ModelError(f"{where}: model_type {config.get('model_type')!r} is not gemma3_text")
    for key in _NOT_THE_MODEL:
        config.pop(key, None)
    per_type = config.get("rope_parameters") or {}
    thetas = {"rope_theta": "full_attention", "rope_local_base_freq": "sliding_attention"}
    for key, kind in thetas.items():
        theta = (per_type.get(kind) or {}).get("rope_theta")
        if theta is None:
            raise ModelError(f"{where}: no rope_parameters.{kind}.rope_theta")
        config[key] = float(theta)
    types = config.get("layer_types") or []
    if "full_attention" not in types:
        raise ModelError(f"{where}: no global layer in layer_types {types!r}")
    pattern = types.index("full_attention") + 1  # layer i is global when (i + 1) % pattern == 0
    config["sliding_window_pattern"] = pattern
    config["architectures"] = ["Gemma3ForCausalLM"]
    config["tie_word_embeddings"] = True
    return config


def read_gemma3_gguf(path: str | Path) -> Gemma3Gguf:
    """Dequantize a Gemma 3 GGUF to float32 with transformers (30-60 s on a CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(path)
    started = time.monotonic()
    log.info("reading %s with transformers (dequantizing: 30-60 s on a CPU)", src.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except (ImportError, OSError, ValueError, KeyError) as e:
        raise ModelError(f"{src}: not a Gemma 3 GGUF transformers can read ({e})") from None
    config = _config(model.config, src)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    log.info("read %d tensors in %.1f s", len(state), time.monotonic() - started)
    return Gemma3Gguf(src, config, state, tokenizer)


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _write_tokenizer(tokenizer: Any, out: Path, max_positions: int) -> None:
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in _TOKENIZER_BOOKKEEPING:
        cfg.pop(key, None)
    cfg["model_max_length"] = max_positions
    cfg_path.write_text(_dump(cfg))


def write_gemma3_hf(model: Gemma3Gguf, out: str | Path, dtype: FloatDtype) -> Path:
    """An HF checkpoint in `dtype`: a fresh Gemma3ForCausalLM (no quantizer) loaded with the
    dequantized weights, saved by transformers, with our config and tokenizer files."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):  # no random init: every weight is assigned below
        hf = Gemma3ForCausalLM(Gemma3TextConfig(**model.config))
    missing, unexpected = hf.load_state_dict(model.state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ModelError(f"{model.source}: weights do not fit ({missing=}, {unexpected=})")
    hf.tie_weights()
    hf.to(getattr(torch, dtype)).save_pretrained(str(dest))
    config = {**model.config, "torch_dtype": dtype}
    (dest / "config.json").write_text(_dump(config))
    _write_tokenizer(model.tokenizer, dest, int(config["max_position_embeddings"]))
    return dest
