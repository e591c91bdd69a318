"""A Llama-family GGUF file (llama.cpp's format) as tandem checkpoints.

Two forms, both from the same bits:
- **MLX quantized**: `mx.load` reads GGUF Q4_0/Q4_1/Q8_0 blocks as MLX affine arrays
  (`weight` uint32, `scales`, `biases`; group 32), so the checkpoint holds the file's exact
  bits and nothing is re-quantized. Modules whose bits differ from the rest (SmolLM2's Q8_0
  embedding) are per-module overrides in `config.json`'s `quantization`, as mlx-lm reads them.
- **HF float** (float32 or bfloat16): the same weights dequantized with `mx.dequantize` in
  float32, in Hugging Face names and layout, which every part of tandem reads.

llama.cpp's converter permutes the rows of Q and K for its RoPE kernel; `_unpermute` undoes it.
A row permutation moves a row's packed words, scales and biases together, so it is exact on
the quantized form too. The tokenizer and chat template come from the GGUF metadata through
transformers (`gguf_file=`). mlx and transformers are imported inside the functions that use
them (DESIGN.md: mlx lives under `nodes/decode/`; this is a preparation command).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.safetensors_format import RawTensor, encode, float_bytes

log = logging.getLogger(__name__)
FloatDtype = Literal["float32", "bfloat16"]

# GGUF tensor names → HF module paths (per layer, then global)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|scales|biases)$")
_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # readable by transformers 4.x and 5.x alike


@dataclass(frozen=True)
class Module:
    """One module's arrays as stored: `weight` (float, or packed uint32 with scales/biases)."""

    weight: np.ndarray
    scales: np.ndarray | None = None
    biases: np.ndarray | None = None

    @property
    def quantized(self) -> bool:
        return self.scales is not None


@dataclass(frozen=True)
class GgufModel:
    """A parsed GGUF: HF config, modules by HF path, and the source file (for the tokenizer)."""

    source: Path
    config: dict[str, Any]
    modules: dict[str, Module]

    def quantization(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of a quantized module, from its packed and grouped widths."""
        m = self.modules[module]
        assert m.scales is not None
        cols = _columns(self.config, module)
        return m.weight.shape[-1] * 32 // cols, cols // m.scales.shape[-1]


def _meta_int(meta: dict[str, Any], key: str) -> int:
    if key not in meta:
        raise ModelError(f"GGUF metadata lacks {key!r}")
    return int(meta[key].item())


def _hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = str(meta.get("general.architecture", ""))
    if arch != "llama":
        raise ModelError(f"GGUF architecture {arch!r} is not supported (only llama)")
    p = f"{arch}."
    hidden = _meta_int(meta, p + "embedding_length")
    heads = _meta_int(meta, p + "attention.head_count")
    theta = float(meta[p + "rope.freq_base"].item()) if p + "rope.freq_base" in meta else 10000.0
    eps = float(meta[p + "attention.layer_norm_rms_epsilon"].item())
    bos = _meta_int(meta, "tokenizer.ggml.bos_token_id")
    eos = _meta_int(meta, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, p + "feed_forward_length"),
        "num_hidden_layers": _meta_int(meta, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(meta, p + "attention.head_count_kv"),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": round(eps, 12),
        "vocab_size": _meta_int(meta, p + "vocab_size"),
        "max_position_embeddings": _meta_int(meta, p + "context_length"),
        # both spellings, explicitly (DESIGN.md config traps)
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": True,  # set from the tensors in read_gguf
        "bos_token_id": bos,
        "eos_token_id": eos,
        "attention_bias": False,
        "mlp_bias": False,
        "use_cache": True,
    }


def _columns(config: dict[str, Any], module: str) -> int:
    """The input width of a module, from the config (packed arrays hide it)."""
    down = module.endswith("mlp.down_proj")
    return int(config["intermediate_size"] if down else config["hidden_size"])


def _unpermute(a: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, the two RoPE halves were interleaved."""
    rows = a.shape[0]
    return a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def read_gguf(path: str | Path) -> GgufModel:
    """Parse a Llama-family GGUF into HF names, Q/K rows in HF order, bits untouched."""
    import mlx.core as mx

    src = Path(path)
    try:
        arrays, meta = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelError(f"{src}: not a readable GGUF file ({e})") from None
    config = _hf_config(meta)
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, array in arrays.items():
        m = _TENSOR_RE.match(name)
        table = _LAYER_NAMES if m and m.group(1) is not None else _GLOBAL_NAMES
        if m is None or m.group(2) not in table:
            raise ModelError(f"{src}: unexpected tensor {name!r}")
        layer, short, part = m.groups()
        module = f"model.layers.{layer}.{table[short]}" if layer is not None else table[short]
        parts.setdefault(module, {})[part] = np.array(array, copy=False)
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}  # fmt: skip
    modules: dict[str, Module] = {}
    for module, p in sorted(parts.items()):
        n_heads = heads.get(module.split(".", 3)[-1])
        if n_heads is not None:
            p = {k: _unpermute(v, n_heads) for k, v in p.items()}
        modules[module] = Module(p["weight"], p.get("scales"), p.get("biases"))
    config["tie_word_embeddings"] = "lm_head" not in modules
    return GgufModel(src, config, modules)


def dequantize(module: Module, group_size: int, bits: int) -> np.ndarray:
    """float32 weights of a quantized module: `scales * q + biases`, by mlx's own kernel."""
    import mlx.core as mx

    assert module.scales is not None and module.biases is not None
    w = mx.dequantize(
        mx.array(module.weight),
        mx.array(module.scales.astype(np.float32)),
        mx.array(module.biases.astype(np.float32)),
        group_size=group_size,
        bits=bits,
    )
    return np.array(w, dtype=np.float32)


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _write_tokenizer(model: GgufModel, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, from the GGUF metadata."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model.source.parent), gguf_file=model.source.name)
    except (ImportError, OSError, ValueError) as e:
        raise ModelError(f"{model.source}: cannot build its tokenizer ({e})") from None
    tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("backend", "is_local", "local_files_only"):  # transformers 5 bookkeeping
        cfg.pop(key, None)
    cfg["tokenizer_class"] = _TOKENIZER_CLASS
    cfg["model_max_length"] = model.config["max_position_embeddings"]
    cfg["add_bos_token"] = False
    template = out / "chat_template.jinja"
    if template.exists():  # one place for the template, which transformers 4.x also reads
        cfg["chat_template"] = template.read_text()
        template.unlink()
    cfg_path.write_text(_dump(cfg))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _write_common(
    model: GgufModel, out: Path, config: dict[str, Any], tokenizer_from: Path | None
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(_dump(config))
    eos = config["eos_token_id"]
    (out / "generation_config.json").write_text(
        _dump({"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False})
    )
    if tokenizer_from is None:
        _write_tokenizer(model, out)
        return
    for name in TOKENIZER_FILES:  # another form's tokenizer: the same files
        shutil.copyfile(tokenizer_from / name, out / name)


def write_mlx(model: GgufModel, out: str | Path, tokenizer_from: Path | None = None) -> Path:
    """The MLX quantized checkpoint: the GGUF's packed bits as mlx-lm loads them.
    `tokenizer_from`: a checkpoint of the same GGUF whose tokenizer files to copy."""
    import mlx.core as mx

    dest = Path(out)
    quantized = {m: model.quantization(m) for m, mod in model.modules.items() if mod.quantized}
    if not quantized:
        raise ModelError(f"{model.source}: holds no quantized tensors")
    # the most common (bits, group) is the default; the rest are per-module overrides
    counts: dict[tuple[int, int], int] = {}
    for q in quantized.values():
        counts[q] = counts.get(q, 0) + 1
    bits, group = max(counts, key=lambda q: counts[q])
    quant: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
    for module, (b, g) in sorted(quantized.items()):
        if (b, g) != (bits, group):
            quant[module] = {"group_size": g, "bits": b}
    for module, mod in model.modules.items():
        if not mod.quantized and mod.weight.ndim == 2:
            quant[module] = False
    # what the model computes in: mlx promotes the float16 scales against the norms' dtype
    # (llama.cpp keeps norms in F32), so activations and the KV cache are float32
    norms = {str(m.weight.dtype) for m in model.modules.values() if m.weight.ndim == 1}
    dtype = "float32" if norms == {"float32"} else "float16"
    config = {**model.config, "quantization": quant, "quantization_config": quant,
              "torch_dtype": dtype}  # fmt: skip
    _write_common(model, dest, config, tokenizer_from)
    tensors: dict[str, Any] = {}
    for module, mod in model.modules.items():
        tensors[f"{module}.weight"] = mx.array(mod.weight)
        if mod.scales is not None and mod.biases is not None:
            tensors[f"{module}.scales"] = mx.array(mod.scales)
            tensors[f"{module}.biases"] = mx.array(mod.biases)
    mx.save_safetensors(str(dest / "model.safetensors"), tensors, metadata={"format": "mlx"})
    return dest


def write_hf(
    model: GgufModel, out: str | Path, dtype: FloatDtype, tokenizer_from: Path | None = None
) -> Path:
    """An HF-format float checkpoint: every module dequantized, stored as `dtype`."""
    dest = Path(out)
    _write_common(model, dest, {**model.config, "torch_dtype": dtype}, tokenizer_from)
    tensors: dict[str, RawTensor] = {}
    for module, mod in sorted(model.modules.items()):
        if mod.quantized:
            bits, group = model.quantization(module)
            w = dequantize(mod, group, bits)
        else:
            w = mod.weight.astype(np.float32)
        st_dtype, data = float_bytes(w, dtype)
        tensors[f"{module}.weight"] = RawTensor(st_dtype, tuple(w.shape), data)
    (dest / "model.safetensors").write_bytes(encode(tensors, {"format": "pt"}))
    return dest
