"""safetensors dtype names ↔ torch dtypes: the one table the prefill side reads and writes by."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.int32,  # packed quantized words: the bits are all that matter
    "U8": torch.uint8,  # the fp modes' scales (e8m0, e4m3 codes)
}

# a float tensor's safetensors name (K/V and compute dtypes; U32 is packed words, not values)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    t: name for name, t in TORCH_DTYPES.items() if t.is_floating_point
}
