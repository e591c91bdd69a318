"""Index every tensor of a checkpoint by layer from the safetensors headers, reading no data."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tandem.nodes.model import gpt_oss_tensors, mla_tensors
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.noaux_moe_config import (
    CORRECTION_BIAS,
    MTP_FAMILIES,
    noaux,
    noaux_mlp_shapes,
)
from tandem.nodes.model.quant import Quant
from tandem.nodes.model.qwen3_5_config import canonical_name, linear_shapes
from tandem.nodes.model.safetensors_format import ITEMSIZE, SafetensorsError, read_header
from tandem.nodes.model.spec import ModelSpec, load_spec

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# a routed layer's experts: stacked [E, out, in] (mlx-community), one by one (Hugging Face), or
# fused (Hugging Face's Qwen3.5-MoE): `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up)
# and `mlp.experts.down_proj` [E, H, I], neither with a `.weight` suffix
ExpertLayout = Literal["stacked", "per-expert", "fused"]
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# float32 in a model of another dtype (Qwen3.5's A_log, the DeepSeek-V3 lineage's router bias)
KEPT_FLOAT32 = frozenset({"linear_attn.A_log", CORRECTION_BIAS})


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: `file` bytes [offset, offset + nbytes)."""

    name: str
    dtype: str  # safetensors spelling: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ModelIndex:
    """A parsed model: its spec, the per-layer tensors (short names), and the global ones."""

    spec: ModelSpec
    layers: tuple[dict[str, TensorEntry], ...]  # "self_attn.q_proj.weight" -> entry
    globals: dict[str, TensorEntry]  # "model.embed_tokens.weight", "model.norm.weight", ...
    files: tuple[Path, ...]
    # added to the RMSNorm weights (input/post-attention/final norms, q_norm, k_norm) before
    # use: 1.0 where a Hugging Face Qwen3.5 checkpoint stores them less one (mlx-lm's rule: a
    # conv1d weight [C, 1, K]); the gated `linear_attn.norm` never has it
    norm_offset: float = 0.0

    @property
    def dtype(self) -> str:
        """The compute dtype (safetensors spelling), as mlx-lm's arithmetic ends up: the
        blocks' float weights' dtype; F32 where a quantized checkpoint's norms and scales
        differ (SmolLM2's GGUF: F32 norms, F16 scales), as mlx promotes."""
        layer = self.layers[0]
        norm = layer["input_layernorm.weight"].dtype
        scales = next(
            (e for k, e in layer.items() if k.endswith(".scales") and e.dtype in FLOAT_DTYPES),
            None,
        )  # an fp mode's scales are bytes (e8m0, e4m3): they promote nothing
        if scales is None or scales.dtype == norm:
            return norm
        return "F32"

    def quant(self, layer: int, module: str) -> Quant | None:
        """How `model.layers.{layer}.{module}` is stored; None for float (norms always are:
        mlx quantizes only linear layers and embeddings). `module@tag` (a second range of one
        matrix in one part) is `module`."""
        module = module.partition("@")[0]
        if f"{module}.scales" not in self.layers[layer]:
            return None
        return self.spec.quantization.of(f"model.layers.{layer}.{module}")

    def global_quant(self, module: str) -> Quant | None:
        """How the global `module` ("model.embed_tokens", "lm_head") is stored; None for float
        (mlx-lm quantizes only the modules stored with scales)."""
        if f"{module}.scales" not in self.globals:
            return None
        return self.spec.quantization.of(module)

    @property
    def quantized(self) -> bool:
        return self.spec.quantization.quantized

    def expert_layout(self, i: int) -> ExpertLayout | None:
        """How layer `i` stores its experts; None where its MLP is dense."""
        return _expert_layout(self.spec, i, self.layers[i])

    def layer_bytes(self, i: int) -> int:
        return sum(e.nbytes for e in self.layers[i].values())

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.globals.values()) + sum(
            self.layer_bytes(i) for i in range(len(self.layers))
        )


def expected_layer_shapes(
    spec: ModelSpec, layer: int = 0, experts: ExpertLayout = "stacked", hf_conv: bool = False,
    hf_mla: bool = False,
) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """The tensors decoder layer `layer` must hold, with their logical (float) shapes; a
    routed layer's experts in the layout `experts`, a linear-attention layer's conv weight
    [C, 1, K] where `hf_conv` (else [C, K, 1]), a latent layer's up-projection whole where
    `hf_mla` (else split per head: `mla_tensors.py`)."""
    h, hd, nh, nkv, inter = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if spec.family == "gpt_oss":
        return gpt_oss_tensors.layer_shapes(spec, "fused" if experts == "fused" else "stacked")
    linear = spec.layer_kinds[layer].kind in ("linear", "latent")  # no q/k/v/o of heads
    if spec.layer_kinds[layer].kind == "latent":
        shapes.update(mla_tensors.attention_shapes(spec, hf_mla))
    elif linear:
        assert spec.linear is not None
        shapes.update(linear_shapes(spec.linear, h, hf_conv))
    else:
        q_rows = nh * hd * (2 if spec.attn_output_gate else 1)  # per head [q, gate]
        shapes["self_attn.q_proj.weight"] = (q_rows, h)
        shapes["self_attn.k_proj.weight"] = (nkv * hd, h)
        shapes["self_attn.v_proj.weight"] = (nkv * hd, h)
        shapes["self_attn.o_proj.weight"] = (h, nh * hd)
    if noaux(spec):  # the DeepSeek-V3 lineage's MLP: dense, or router, shared and experts
        shapes.update(noaux_mlp_shapes(spec, layer, experts))
    elif spec.moe is not None and spec.moe.sparse[layer]:
        shapes.update(_expert_shapes(spec, experts))
    else:
        shapes["mlp.gate_proj.weight"] = (inter, h)
        shapes["mlp.up_proj.weight"] = (inter, h)
        shapes["mlp.down_proj.weight"] = (h, inter)
    if spec.attention_bias and not linear:
        shapes["self_attn.q_proj.bias"] = (nh * hd,)
        shapes["self_attn.k_proj.bias"] = (nkv * hd,)
        shapes["self_attn.v_proj.bias"] = (nkv * hd,)
    if spec.qk_norm and not linear:
        shapes["self_attn.q_norm.weight"] = (hd,)
        shapes["self_attn.k_norm.weight"] = (hd,)
    if spec.post_norms:  # Gemma 3: post_attention_layernorm norms the attention's output
        shapes["pre_feedforward_layernorm.weight"] = (h,)
        shapes["post_feedforward_layernorm.weight"] = (h,)
    return shapes


def _expert_shapes(spec: ModelSpec, layout: ExpertLayout) -> dict[str, tuple[int, ...]]:
    """A routed layer's router [E, H], experts ([E, out, in] stacked, [out, in] each, or
    fused) and shared expert with its gate [1, H], if any."""
    assert spec.moe is not None
    h, n, inter = spec.hidden_size, spec.moe.num_experts, spec.moe.intermediate_size
    each = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (n, h)}
    if layout == "fused":
        shapes["mlp.experts.gate_up_proj"] = (n, 2 * inter, h)
        shapes["mlp.experts.down_proj"] = (n, h, inter)
    shared = spec.moe.shared_intermediate_size
    if shared:
        shapes["mlp.shared_expert.gate_proj.weight"] = (shared, h)
        shapes["mlp.shared_expert.up_proj.weight"] = (shared, h)
        shapes["mlp.shared_expert.down_proj.weight"] = (h, shared)
        shapes["mlp.shared_expert_gate.weight"] = (1, h)
    for proj in PROJECTIONS if layout != "fused" else ():
        if layout == "stacked":
            shapes[f"mlp.switch_mlp.{proj}.weight"] = (n, *each[proj])
        else:
            shapes.update({f"mlp.experts.{e}.{proj}.weight": each[proj] for e in range(n)})
    return shapes


def _expert_layout(spec: ModelSpec, i: int, tensors: dict[str, TensorEntry]) -> ExpertLayout | None:
    """The layout layer `i`'s tensors hold its experts in (None: a dense MLP); ModelError
    where they hold both or neither."""
    if spec.moe is None or not spec.moe.sparse[i]:
        return None
    if spec.family == "gpt_oss":
        return gpt_oss_tensors.layout(tensors)
    fused = "mlp.experts.gate_up_proj" in tensors
    found: list[ExpertLayout] = [
        layout
        for layout, present in (
            ("stacked", any(k.startswith("mlp.switch_mlp.") for k in tensors)),
            ("per-expert", not fused and any(k.startswith("mlp.experts.") for k in tensors)),
            ("fused", fused),
        )
        if present
    ]
    if len(found) > 1:
        raise ModelError(f"{spec.path}: layer {i} holds its experts both {found[0]} and {found[1]}")
    if not found:
        raise ModelError(
            f"{spec.path}: layer {i} routes to {spec.moe.num_experts} experts but holds "
            "none (neither mlp.switch_mlp.*_proj.weight, mlp.experts.E.*_proj.weight nor "
            "mlp.experts.gate_up_proj)"
        )
    return found[0]


def _shard_files(path: Path) -> list[Path]:
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ModelError(f"{index_file}: malformed shard index ({e})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        raise ModelError(f"{path}: no model.safetensors or model.safetensors.index.json")
    for f in files:
        if not f.exists():
            raise ModelError(f"{f}: shard listed in the index is missing")
    return files


def load_index(model_dir: str | Path, require_data: bool = True) -> ModelIndex:
    """Parse the spec and every shard header; check that each layer holds what its family needs.

    `require_data=False` accepts shards that hold only their header (no tensor bytes): enough
    to plan and cost a model (`tandem plan`) without its weights on this machine.
    """
    path = Path(model_dir)
    spec = load_spec(path)
    files = _shard_files(path)
    layers: list[dict[str, TensorEntry]] = [{} for _ in range(spec.num_layers)]
    globals_: dict[str, TensorEntry] = {}
    for f in files:
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                entries, _, data_start = read_header(fh)
        except SafetensorsError as e:
            raise ModelError(f"{f}: corrupt safetensors header ({e})") from None
        except OSError as e:
            raise ModelError(f"{f}: cannot read ({e.strerror})") from None
        for name, h in entries.items():
            if require_data and data_start + h.end > size:
                raise ModelError(f"{f}: tensor {name} runs past the end of the file")
            entry = TensorEntry(name, h.dtype, h.shape, f, data_start + h.begin, h.end - h.begin)
            canonical = canonical_name(name)
            if canonical is None:
                continue
            m = _LAYER_RE.match(canonical)
            if m is None:
                globals_[canonical] = entry
                continue
            i = int(m.group(1))
            if i >= spec.num_layers and spec.family in MTP_FAMILIES:
                continue  # a multi-token-prediction layer, which mlx-lm's sanitize drops
            if i >= spec.num_layers:
                raise ModelError(f"{f}: tensor {name} beyond num_hidden_layers={spec.num_layers}")
            short = m.group(2)
            if spec.family == "gpt_oss":
                short, entry = gpt_oss_tensors.hf_entry(short, entry)
            layers[i][short] = entry
    # mlx-lm's rule for a Hugging Face Qwen3.5 checkpoint: a conv weight [C, 1, K]
    hf = any(e.shape[-1] != 1 for t in layers for k, e in t.items() if k.endswith("conv1d.weight"))
    _check(spec, layers, globals_, path, hf)
    return ModelIndex(
        spec=spec, layers=tuple(layers), globals=globals_, files=tuple(files),
        norm_offset=1.0 if hf else 0.0,
    )  # fmt: skip


FLOAT_DTYPES = ("F32", "F16", "BF16")


def stored_shapes(
    name: str, shape: tuple[int, ...], quant: Quant | None
) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """The tensors that store a module's weight `name` of logical `shape` ([out, in], or
    [E, out, in] for stacked experts), with the dtypes each may have: the float weight, or
    packed words plus scales (one per group of input columns): float with as many biases
    (affine), else uint8 (e8m0 or e4m3: the fp modes) alone."""
    if quant is None or len(shape) not in (2, 3) or not name.endswith(".weight"):
        return {name: (shape, FLOAT_DTYPES)}
    *rows, cols = shape
    module = name.removesuffix(".weight")
    groups = (*rows, quant.groups(cols))
    stored = {
        name: ((*rows, quant.packed_cols(cols)), ("U32",)),
        f"{module}.scales": (groups, FLOAT_DTYPES if quant.biases else ("U8",)),
    }
    if quant.biases:
        stored[f"{module}.biases"] = (groups, FLOAT_DTYPES)
    return stored


def _check_stored(
    tensors: dict[str, TensorEntry], name: str, shape: tuple[int, ...], quant: Quant | None,
    prefix: str, path: Path,
) -> None:  # fmt: skip
    cols = shape[-1] if len(shape) >= 2 else 0
    if quant is not None and cols % quant.group_size:
        raise ModelError(
            f"{path}: {prefix}{name} has {cols} columns, not whole groups of {quant.group_size}"
        )
    scale = f"{name.removesuffix('.weight')}.global_scale"
    if quant is not None and scale in tensors:  # mlx-lm's per-expert nvfp4 tensor scale
        raise ModelError(
            f"{path}: {prefix}{scale}: nvfp4 with a global scale is not supported (mlx runs "
            "it on the GPU only); requantize without one"
        )
    for stored, (want, dtypes) in stored_shapes(name, shape, quant).items():
        entry = tensors.get(stored)
        if entry is None:
            raise ModelError(f"{path}: missing tensor {prefix}{stored}")
        if entry.shape != want:
            raise ModelError(f"{entry.file}: {entry.name} has shape {entry.shape}, expected {want}")
        if entry.dtype not in dtypes:
            raise ModelError(f"{entry.file}: {entry.name} has unsupported dtype {entry.dtype}")


def _check(
    spec: ModelSpec,
    layers: list[dict[str, TensorEntry]],
    globals_: dict[str, TensorEntry],
    path: Path,
    hf_conv: bool = False,
) -> None:
    # mlx-lm quantizes the modules stored with scales only (`class_predicate`), whatever the
    # default says: a converted Hugging Face gpt-oss keeps its embedding and attention float
    def quant_of(tensors: dict[str, TensorEntry], prefix: str, module: str) -> Quant | None:
        weight = tensors.get(f"{module}.weight")
        packed = f"{module}.scales" in tensors or (weight is not None and weight.dtype == "U32")
        return spec.quantization.of(prefix + module) if packed else None

    embed_quant = quant_of(globals_, "", "model.embed_tokens")
    _check_stored(globals_, "model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size),
                  embed_quant, "", path)  # fmt: skip
    if "model.norm.weight" not in globals_:
        raise ModelError(f"{path}: missing tensor model.norm.weight")
    if not spec.tie_word_embeddings and "lm_head.weight" not in globals_:
        raise ModelError(f"{path}: missing tensor lm_head.weight (tie_word_embeddings is false)")
    dtype = None
    for i, tensors in enumerate(layers):
        prefix = f"model.layers.{i}."
        layout = _expert_layout(spec, i, tensors) or "stacked"
        hf_mla = mla_tensors.HF_UP in tensors
        for short, shape in expected_layer_shapes(spec, i, layout, hf_conv, hf_mla).items():
            quant = quant_of(tensors, prefix, short.removesuffix(".weight"))
            if short.endswith("conv1d.weight"):
                quant = None  # mlx quantizes linear layers and embeddings only
            _check_stored(tensors, short, shape, quant, prefix, path)
            for stored in stored_shapes(short, shape, quant):
                entry = tensors[stored]
                if entry.dtype == "U32":
                    continue
                if short in KEPT_FLOAT32 and entry.dtype == "F32":
                    continue  # mlx-lm never casts it (`cast_predicate`)
                dtype = dtype or entry.dtype
                if entry.dtype != dtype and not spec.quantization.quantized:
                    raise ModelError(
                        f"{entry.file}: {entry.name} is {entry.dtype}, other layers {dtype}"
                    )
