"""The room a CUDA node pins for a layer's handover before the pass (issue 48 item 9: a layer
larger than the buffers re-pinned them mid-pass): the bound holds every layer's K/V, their
quantized form, or a linear layer's state, for every family."""

from __future__ import annotations

import numpy as np
import pytest
from tandem.nodes.contract.http import KVFormat
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.handover import LayerKV, handover_bytes

from tests.conftest import MakeTiny


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


@pytest.mark.parametrize(
    "args",
    [{"arch": "llama"}, {"arch": "gemma3"}, {"arch": "qwen3_5", "vocab": 320}],
    ids=["llama", "gemma3", "qwen3_5"],
)
@pytest.mark.parametrize("bits", [None, 8])
def test_the_bound_holds_every_layers_handover(
    args: dict[str, object], bits: int | None, tiny_model: MakeTiny
) -> None:
    index = load_index(tiny_model(layers=4, head_dim=64, **args))
    engine = PrefillEngine(index, device="cpu")
    try:
        for n in (1, 7, 90):
            ids = np.random.default_rng(n).integers(0, index.spec.vocab_size, n).tolist()
            fmt = KVFormat(bits) if bits else None
            for item in engine.prefill(ids, kv_format=fmt):
                if isinstance(item, LayerKV):
                    tensors = [item.k, item.v, *(item.quantized or {}).values()]
                else:
                    tensors = list(item.tensors.values())
                need = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
                assert need <= handover_bytes(index.spec, 4, n), (n, item.layer)
    finally:
        engine.close()
