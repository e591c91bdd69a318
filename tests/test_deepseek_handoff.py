"""DeepSeek V3 through real nodes: a remote prefill (at a budget below one layer's experts)
sends each layer's latents and rope keys (the "latent" kind, proto 5), which fill mlx-lm's own
caches; greedy tokens equal mlx-lm's own generation; three turns through the prompt cache; at
2k tokens the wire carries the latents, not per-head K/V; `kv_bits` refused (mlx-lm attends
over a latent cache in float only)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from tandem.nodes.model.index import load_index

from tests.conftest import MakeTiny
from tests.handoff_checks import assert_three_turns_reuse_the_cache, greedy_ids, served_text
from tests.test_deepseek_v3 import ARGS
from tests.test_gpt_oss_handoff import _complete
from tests.test_handoff import Cluster, _cluster


@pytest.fixture(scope="module")
def cluster(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _cluster(tmp_path_factory.mktemp("deepseek"), tiny_model(**ARGS))


def test_remote_prefill_is_exactly_mlx_greedy_and_sends_latents(cluster: Cluster) -> None:
    spec = load_index(cluster.model).spec
    assert spec.mla is not None
    for n in (30, 2048):
        prompt = [(29 * i + n) % spec.vocab_size for i in range(n)]
        text, stats = _complete(cluster, prompt)
        assert stats.prefill == "remote", cluster.decode.output()
        assert text == served_text(cluster, greedy_ids(cluster, prompt))
        # per position and layer one latent and one rope key (float32), plus frame headers
        latent = (spec.mla.kv_lora_rank + spec.mla.rope_dim) * 4 * spec.num_layers
        assert 0 < stats.kv_bytes - latent * (n - 1) < 1024 * spec.num_layers
        per_head = 2 * spec.num_heads * spec.mla.q_dim * 4 * spec.num_layers  # K/V of 4 heads
        assert stats.kv_bytes < 0.2 * per_head * (n - 1)


def test_three_turns_reuse_the_cache_exactly(cluster: Cluster) -> None:
    vocab = load_index(cluster.model).spec.vocab_size
    fresh = [[(7 * turn + 3 * i + 1) % vocab for i in range(20)] for turn in range(3)]
    assert_three_turns_reuse_the_cache(cluster, fresh)


def test_quantized_kv_is_refused(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError, match="float only"):
        cluster.client().completions.create(
            model="m", prompt=[1, 2, 3], max_tokens=2, extra_body={"tandem": {"kv_bits": 8}}
        )
