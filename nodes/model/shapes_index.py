"""A model's index from its `config.json` alone: every tensor its family holds, with the shapes
and dtypes the config implies (quantized where its quantization says), in no file.

Enough to plan and cost a model that is not on this machine (`tandem plan` on a directory
holding only a config: "will gpt-oss-120b fit my 24 GB card?" before a 65 GB download). The
bytes are the checkpoint's to within its metadata; a checkpoint's own headers, where present,
are read instead (`load_index`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from tandem.nodes.model.index import (
    FLOAT_DTYPES,
    KEPT_FLOAT32,
    ExpertLayout,
    ModelIndex,
    TensorEntry,
    expected_layer_shapes,
    stored_shapes,
)
from tandem.nodes.model.noaux_moe_config import ROUTER_FLOAT, noaux
from tandem.nodes.model.quant import Quant
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import load_spec

_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def shapes_index(model_dir: str | Path) -> ModelIndex:
    """The index `load_index` would read from the checkpoint `config.json` describes."""
    path = Path(model_dir)
    spec = load_spec(path)
    where = path / "config.json"
    entries = _Entries(where, _DTYPES.get(spec.torch_dtype, "BF16"))
    h = spec.hidden_size
    # a transformers quantization (OpenAI's gpt-oss) stores its experts fused, mlx-lm's stacked
    raw = json.loads(where.read_text()).get("quantization_config") or {}
    layout: ExpertLayout = "fused" if "quant_method" in raw else "stacked"
    layers = []
    for i in range(spec.num_layers):
        tensors: dict[str, TensorEntry] = {}
        for short, shape in expected_layer_shapes(spec, i, layout).items():
            quant = spec.quantization.of(f"model.layers.{i}.{short.removesuffix('.weight')}")
            if short.endswith(("norm.weight", "conv1d.weight", ".bias", "sinks")):
                quant = None  # mlx quantizes linear layers' weights only
            if noaux(spec) and short in ROUTER_FLOAT:
                quant = None  # the DeepSeek-V3 lineage's router: no Linear in mlx-lm
            tensors.update(entries.stored(short, shape, quant, short in KEPT_FLOAT32))
        layers.append(tensors)
    globals_ = entries.stored(
        "model.embed_tokens.weight",
        (spec.vocab_size, h),
        spec.quantization.of("model.embed_tokens"),
    )
    globals_["model.norm.weight"] = entries.entry("model.norm.weight", (h,))
    if not spec.tie_word_embeddings:
        head = spec.quantization.of("lm_head")
        globals_.update(entries.stored("lm_head.weight", (spec.vocab_size, h), head))
    return ModelIndex(spec=spec, layers=tuple(layers), globals=globals_, files=())


@dataclasses.dataclass
class _Entries:
    """Entries laid out one after another in an imagined file."""

    file: Path
    dtype: str  # the float tensors'
    offset: int = 0

    def entry(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> TensorEntry:
        dtype = dtype or self.dtype
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        e = TensorEntry(name, dtype, shape, self.file, self.offset, nbytes)
        self.offset += nbytes
        return e

    def stored(
        self, name: str, shape: tuple[int, ...], quant: Quant | None, float32: bool = False
    ) -> dict[str, TensorEntry]:
        """The tensors storing `name` (`float32`: a float one kept float32, `KEPT_FLOAT32`)."""
        out = {}
        for stored, (dims, dtypes) in stored_shapes(name, shape, quant).items():
            dtype = self.dtype if dtypes == FLOAT_DTYPES else dtypes[0]
            dtype = "F32" if float32 and dtypes == FLOAT_DTYPES else dtype
            out[stored] = self.entry(stored, dims, dtype)
        return out
