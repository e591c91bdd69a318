"""Write a prefill's handovers as an mlx-lm prompt cache file (`load_prompt_cache` reads it),
no mlx: every layer kind in the cache class mlx-lm's own `make_cache()` gives it.

mlx-lm's `save_prompt_cache` flattens `[c.state for c in caches]` (`tree_flatten`: nested
lists and tuples by index, `"{layer}.{item}[.{sub}]"`) into arrays, turning each plain value
into an array and naming it in the metadata; the metadata is `[user_metadata, class_names,
scalars]` flattened the same way: `"0.{key}"` the user's (`mlx_lm.generate
--prompt-cache-file` reads its `model` and `tokenizer_config`), `"1.{layer}"` the class,
`"2.0": ""`, then per plain value in order `"2.{j}.0"` its key and `"2.{j}.1"` its type
(`"scalar"` or `"none"`). The states, as mlx-lm 0.32 holds them:

- `KVCache`: keys, values [1, n_kv, T, D], offset T;
- `QuantizedKVCache`: (words, scales, biases) for keys, the same for values, offset, group
  size, bits;
- `RotatingKVCache` (a sliding layer): the last `w <= window` positions' keys and values in
  order, offset T, keep 0, max size `window`, index `w` (what the decode node's
  `lm.fill_window` sets: its next step trims and rotates as after mlx-lm's own prefill);
- `ArraysCache` (a linear layer): its slots in the header's state order (Qwen3.5: conv,
  recurrent), no left padding, no lengths.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.model.safetensors_format import RawTensor, encode
from tandem.nodes.model.spec import LayerKind
from tandem.nodes.prefill.dtypes import SAFETENSORS_DTYPES
from tandem.nodes.prefill.handover import Handed, LayerKV, LinearState

KEEP = 0  # a sliding layer's kept first positions (mlx-lm's make_cache: none)

# a layer's state: arrays, plain ints, None, and tuples of them (mlx-lm's `state`)
State = torch.Tensor | int | None | tuple["State", ...]


def tensor_bytes(t: torch.Tensor) -> tuple[str, bytes]:
    """(safetensors dtype, raw row-major bytes); bf16 as raw bits, never through float32;
    packed quantized words (uint32, or their int32 view) as U32."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.int32, torch.uint32):
        return "U32", t.view(torch.int32).numpy().tobytes()
    dtype = SAFETENSORS_DTYPES[t.dtype]
    raw = t.view(torch.uint16) if t.dtype == torch.bfloat16 else t
    return dtype, raw.numpy().tobytes()


def cache_state(
    item: Handed, kind: LayerKind, end: int, kv_format: KVFormat | None
) -> tuple[str, State]:
    """(mlx-lm cache class, its state) of one layer's handover after positions 0..end-1."""
    if isinstance(item, LinearState):
        return "ArraysCache", (tuple(item.tensors.values()), None, None)
    assert isinstance(item, LayerKV)
    if kind.kind == "sliding":
        assert kind.window is not None
        k, v = item.k[:, :, -kind.window :], item.v[:, :, -kind.window :]
        return "RotatingKVCache", (k, v, end, KEEP, kind.window, k.shape[2])
    if item.quantized is not None:
        assert kv_format is not None
        q = item.quantized
        keys = (q["k"], q["k_scales"], q["k_biases"])
        values = (q["v"], q["v_scales"], q["v_biases"])
        return "QuantizedKVCache", (keys, values, end, kv_format.group_size, kv_format.bits)
    return "KVCache", (item.k, item.v, end)


def write_prompt_cache(
    path: str | Path,
    layers: Sequence[Handed],
    kinds: Sequence[LayerKind],
    end: int,
    kv_format: KVFormat | None = None,
    user_metadata: Mapping[str, str] | None = None,
) -> None:
    """Atomically write every layer's handover of positions 0..end-1 as an mlx-lm prompt
    cache (`kinds[i]`: layer i's kind; `kv_format`: the one its full layers were quantized to;
    `user_metadata`: what `load_prompt_cache(..., return_metadata=True)` gives back)."""
    if len(layers) != len(kinds):
        raise ValueError(f"{len(layers)} layers handed over for a model of {len(kinds)}")
    tensors: dict[str, RawTensor] = {}
    metadata = {f"0.{key}": value for key, value in (user_metadata or {}).items()}
    metadata["2.0"] = ""
    plain: list[tuple[str, str]] = []  # (key, "scalar" | "none"), in flattening order

    def flatten(key: str, value: State) -> None:
        if isinstance(value, tuple):
            for j, sub in enumerate(value):
                flatten(f"{key}.{j}", sub)
        elif isinstance(value, torch.Tensor):
            dtype, data = tensor_bytes(value)
            tensors[key] = RawTensor(dtype, tuple(value.shape), data)
        elif value is None:  # mlx-lm saves None as an empty float32 array
            tensors[key] = RawTensor("F32", (0,), b"")
            plain.append((key, "none"))
        else:
            tensors[key] = RawTensor("I32", (), struct.pack("<i", value))
            plain.append((key, "scalar"))

    for i, (item, kind) in enumerate(zip(layers, kinds, strict=True)):
        if item.layer != i:
            raise ValueError(f"layer {item.layer} handed over in place {i}")
        name, state = cache_state(item, kind, end, kv_format)
        metadata[f"1.{i}"] = name
        flatten(str(i), state)
    for j, (key, what) in enumerate(plain, start=1):
        metadata[f"2.{j}.0"], metadata[f"2.{j}.1"] = key, what
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(encode(tensors, metadata))
    os.replace(tmp, path)
