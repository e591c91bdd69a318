"""Which decode family does what (nodes/decode/families/): the dense family fills every
family's full-attention layers, a model type no family lists is filled as dense but runs its
last token whole, and a kind a family does not fill is the peer's error."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache
from tandem.nodes.contract.frames import ProtocolError
from tandem.nodes.decode.families import family_for
from tandem.nodes.decode.families.base import LayerArrays
from tandem.nodes.decode.families.llama import DenseFamily, GenericFamily
from tandem.nodes.model.spec import FULL, LayerKind

from tests.conftest import MakeTiny

K = mx.arange(2 * 3 * 8, dtype=mx.float32).reshape(1, 2, 3, 8)  # [1, n_kv, count, D]


def _arrays(end: int = 3) -> LayerArrays:
    return LayerArrays(0, {"k": K, "v": K + 1}, end)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_5", "phi3"])
def test_every_family_fills_full_layers_as_the_dense_family(model_type: str) -> None:
    family = family_for(model_type)
    assert isinstance(family, DenseFamily)
    cache = family.fill(FULL, KVCache(), _arrays(), None)
    assert cache.offset == 3
    keys, values = cache.state[:2]
    assert mx.array_equal(keys[..., :3, :], K).item()
    assert mx.array_equal(values[..., :3, :], K + 1).item()


def test_a_type_no_family_lists_runs_its_last_token_whole(tiny_model: MakeTiny) -> None:
    model, _ = load(str(tiny_model(arch="llama", layers=2)))
    caches = [KVCache() for _ in range(2)]
    assert isinstance(family_for("phi3"), GenericFamily)
    assert family_for("phi3").stepper(model, 5, caches) is None
    assert family_for("llama").stepper(model, 5, caches) is not None
    for model_type in ("gemma3_text", "qwen3_5"):
        assert family_for(model_type).stepper(model, 5, caches) is None


@pytest.mark.parametrize("model_type", ["llama", "phi3", "qwen3_5"])
def test_a_sliding_layer_is_refused_where_the_family_has_none(model_type: str) -> None:
    with pytest.raises(ProtocolError, match="sliding layer"):
        family_for(model_type).fill(
            LayerKind("sliding", 4), RotatingKVCache(max_size=4), _arrays(), None
        )
