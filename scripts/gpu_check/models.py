"""The check's models: tiny ones by make_model, the big one drawn by torch on the device."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .context import Ctx
from .sizes import Json


def tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def small_model(ctx: Ctx, name: str, shape: Json, dtype: str) -> Path:
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    args = MakeModelArgs(**shape, dtype=dtype)  # type: ignore[arg-type]
    return make_model(ctx.work / f"{name}-{dtype}", args, with_tokenizer=False)


def write_random_model(out: Path, shape: Json, dtype: str, device: str) -> Path:
    """make_model's layout with the weights drawn by torch, on the GPU where there is one:
    make_model rounds to bf16 in numpy at ~20 M values/s, minutes for a 7 GB model."""
    import numpy as np
    import torch
    from tandem.nodes.model.factory import MakeModelArgs, _config
    from tandem.nodes.model.index import expected_layer_shapes
    from tandem.nodes.model.safetensors_format import RawTensor, encode_parts
    from tandem.nodes.model.spec import load_spec

    args = MakeModelArgs(**shape, dtype=dtype)  # type: ignore[arg-type]
    head_dim = args.hidden // args.heads
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(_config(args, head_dim, 0, 1), indent=2))
    spec = load_spec(out)
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, torch.float32)
    st_dtype = {"bfloat16": "BF16", "float16": "F16"}.get(dtype, "F32")
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def draw(name: str, shape: tuple[int, ...]) -> RawTensor:
        x = torch.randn(shape, generator=gen, device=device)
        if len(shape) == 1:  # norms
            x = 1.0 + 0.1 * x
        elif "embed" not in name:
            x = x / shape[1] ** 0.5
        host = x.to(tdtype).cpu().contiguous()
        raw = host.view(torch.int16) if host.element_size() == 2 else host
        return RawTensor(st_dtype, shape, memoryview(raw.numpy().reshape(-1).view(np.uint8)))

    layer_shapes = expected_layer_shapes(spec)
    per_shard = -(-args.layers // args.shards)
    weight_map: dict[str, str] = {}
    for k in range(args.shards):
        names: dict[str, tuple[int, ...]] = {}
        if k == 0:
            names["model.embed_tokens.weight"] = (args.vocab, args.hidden)
        for i in range(k * per_shard, min(args.layers, (k + 1) * per_shard)):
            names |= {f"model.layers.{i}.{n}": s for n, s in layer_shapes.items()}
        if k == args.shards - 1:
            names["model.norm.weight"] = (args.hidden,)
            names["lm_head.weight"] = (args.vocab, args.hidden)
        fname = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
        tensors = {name: draw(name, s) for name, s in names.items()}
        with open(out / fname, "wb") as f:
            for part in encode_parts(tensors, {"format": "pt"}):
                f.write(part)
            f.flush()
            os.fsync(f.fileno())  # clean pages: a cold pass can evict them (bench --cold)
        weight_map |= dict.fromkeys(names, fname)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out
