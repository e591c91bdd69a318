"""Router unit tests with injected rates: local for short prompts, remote for long ones."""

from __future__ import annotations

from tandem.nodes.contract.cluster import Peer
from tandem.nodes.decode.remote import RemoteResult
from tandem.nodes.decode.router import LocalRate, choose, predict_remote_s
from tandem.nodes.model.kv_bytes import KVBytes

GPU = Peer(address="http://gpu:8470", trusted=True, reason=None, roles=("prefill",),
           prefill_tok_s=4000.0, link_Bps=1.25e9, prefill_floor_s=2.0)  # fmt: skip
MAC = LocalRate(tok_s=500.0, floor_s=0.05)  # a 70B-class model: one step ~50 ms
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-8B-like: 131 KB per token
KV = KVBytes((KV_PER_TOKEN // 32,) * 32, (None,) * 32)


def test_short_prompt_stays_local() -> None:
    d = choose("auto", 5, KV, local=MAC, peers=[GPU])
    assert d.where == "local"
    assert d.local_s is not None and d.remote_s is not None and d.local_s < d.remote_s


def test_long_prompt_goes_remote() -> None:
    d = choose("auto", 8000, KV, local=MAC, peers=[GPU])
    assert d.where == "remote" and d.peer == GPU


def test_slow_link_keeps_long_prompt_local() -> None:
    slow = Peer(address="http://gpu", trusted=True, roles=("prefill",), prefill_tok_s=4000.0,
                link_Bps=1e6)  # fmt: skip
    d = choose("auto", 8000, KV, local=MAC, peers=[slow])
    assert d.where == "local"


def test_fastest_peer_wins() -> None:
    slow = Peer(address="http://slow", trusted=True, roles=("prefill",), prefill_tok_s=100.0,
                link_Bps=1.25e9)  # fmt: skip
    d = choose("auto", 8000, KV, local=LocalRate(50.0, 0.05), peers=[slow, GPU])
    assert d.peer == GPU


def test_modes() -> None:
    assert choose("never", 8000, KV, MAC, [GPU]).where == "local"
    assert choose("always", 5, KV, MAC, [GPU]).where == "remote"
    assert choose("always", 5, KV, MAC, []).where == "local"
    assert choose("auto", 0, KV, MAC, [GPU]).where == "local"
    assert choose("auto", 8000, KV, LocalRate(), [GPU]).where == "remote"


def test_remote_floor_keeps_medium_prompts_local() -> None:
    # 500 tokens: 1 s locally, but one pass of the weights through the GPU costs 2 s
    assert choose("auto", 500, KV, MAC, [GPU]).where == "local"
    assert choose("auto", 2000, KV, MAC, [GPU]).where == "remote"


def test_transfer_overlaps_compute() -> None:
    # compute-bound: the transfer hides behind compute, so time ~ compute, not compute + transfer
    n, kv = 16000, 16000 * KV_PER_TOKEN
    t = predict_remote_s(n, kv, 32, GPU)
    compute, transfer = n / GPU.prefill_tok_s, kv / GPU.link_Bps
    assert max(compute, transfer) < t < compute + transfer


def test_the_rate_learned_is_the_computes_not_the_links() -> None:
    # compute-bound: 2 s of compute, then the last of 16 layers' frames (0.1 s of 1.6)
    fast_link = RemoteResult("http://gpu", 4000, 10**8, 2.1, 1.6)
    assert fast_link.compute_tok_s(16) == 4000 / 2.0
    # the link bound it (frames 5 s of 5.2): the compute's time is not seen, nothing learned,
    # so a request with a quarter of the bytes is not charged the old link's time
    slow_link = RemoteResult("http://gpu", 4000, 10**8, 5.2, 5.0)
    assert slow_link.compute_tok_s(16) is None
    assert RemoteResult("http://gpu", 0, 0, 1.0, 0.0).compute_tok_s(16) is None


def test_a_queued_prefill_node_counts_the_wait_it_would_join() -> None:
    """Issue 46: 8000 tokens go remote to an idle GPU (4 s there, 16 s here), but not behind
    four queued 16k-token prompts (a floor and 4 s each); nor behind the same in flight from
    this node before the node's `/health` says so."""
    from dataclasses import replace

    from tandem.nodes.contract.cluster import PrefillQueue
    from tandem.nodes.decode.router import Ahead

    assert choose("auto", 8000, KV, MAC, [GPU]).where == "remote"
    busy = replace(
        GPU, queue=PrefillQueue(3, tokens_waiting=48000, running_tokens=16000, running=1)
    )
    d = choose("auto", 8000, KV, MAC, [busy])
    assert d.where == "local" and d.remote_s is not None and d.remote_s > 4 * 6.0
    mine = {GPU.address: Ahead(requests=4, tokens=64000)}
    assert choose("auto", 8000, KV, MAC, [GPU], mine).where == "local"
    # two nodes: the idle one wins
    other = replace(GPU, address="http://gpu2:8470")
    assert choose("auto", 8000, KV, MAC, [busy, other]).peer == other
