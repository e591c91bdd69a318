"""Write per-layer K/V as an mlx-lm prompt cache file (`load_prompt_cache` reads it), no mlx.

mlx-lm's `save_prompt_cache` layout for a list of `KVCache`: arrays `"{i}.0"` (keys),
`"{i}.1"` (values), `"{i}.2"` (offset, int32 scalar); metadata flattened from
`[user_metadata, class_names, scalars]`: `"1.{i}": "KVCache"`, `"2.0": ""` and per layer
`"2.{i+1}.0": "{i}.2"`, `"2.{i+1}.1": "scalar"`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from tandem.nodes.model.safetensors_format import RawTensor, encode
from tandem.nodes.prefill.dtypes import SAFETENSORS_DTYPES


def tensor_bytes(t: torch.Tensor) -> tuple[str, bytes]:
    """(safetensors dtype, raw row-major bytes); bf16 as raw bits, never through float32."""
    t = t.detach().to("cpu").contiguous()
    dtype = SAFETENSORS_DTYPES[t.dtype]
    raw = t.view(torch.uint16) if t.dtype == torch.bfloat16 else t
    return dtype, raw.numpy().tobytes()


def write_prompt_cache(path: str | Path, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Atomically write layers' (K, V) [1, n_kv, T, D] as an mlx-lm prompt cache."""
    tensors: dict[str, RawTensor] = {}
    metadata: dict[str, str] = {"2.0": ""}
    for i, (k, v) in enumerate(kv):
        for j, t in enumerate((k, v)):
            dtype, data = tensor_bytes(t)
            tensors[f"{i}.{j}"] = RawTensor(dtype, tuple(t.shape), data)
        tensors[f"{i}.2"] = RawTensor("I32", (), struct.pack("<i", k.shape[2]))
        metadata[f"1.{i}"] = "KVCache"
        metadata[f"2.{i + 1}.0"] = f"{i}.2"
        metadata[f"2.{i + 1}.1"] = "scalar"
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(encode(tensors, metadata))
    os.replace(tmp, path)
