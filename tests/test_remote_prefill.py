"""The decode node's side of `/v1/prefill` in-process (nodes/decode/remote.py): caches filled
from a stream read in place, frame buffers reused, each failure a RemotePrefillError."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from tandem.nodes.cluster.peers import PeerTable
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.contract.events import EventBus, LinkEvent
from tandem.nodes.decode.families.base import KVShape
from tandem.nodes.decode.host import ModelHost
from tandem.nodes.decode.remote import BufferPool, PrefillCall, RemotePrefill, RemotePrefillError
from tandem.nodes.model import fingerprint, load_index

from tests.fake_prefill import start_fake_prefill

TOKEN = "t0ken"


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model(arch="llama", layers=2)


@pytest.fixture(scope="module")
def host(model: Path) -> Iterator[ModelHost]:
    h = ModelHost(model)
    asyncio.run(h.start())
    yield h
    h.close()


async def _prefill(
    host: ModelHost, model: Path, url: str, pool: BufferPool, timeout_s: float = 30.0
) -> tuple[list, EventBus]:
    caches = await host.thread.call(host.new_cache)
    events = EventBus()
    call = PrefillCall("r1", list(range(1, 40)), 0, timeout_s)
    await client(host, model, pool, url)(url, call, caches, events)
    return caches, events


def client(host: ModelHost, model: Path, pool: BufferPool, url: str) -> RemotePrefill:
    """The client of a decode node whose peer table trusts the fake at `url`."""
    index = load_index(model)
    spec = index.spec
    expect = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, index.dtype)
    peers = PeerTable("decode-test", fingerprint(index), TOKEN)
    peers.peers[url] = Peer(url, id="fake", trusted=True, reason=None)
    return RemotePrefill(host, expect, fingerprint(index), peers, pool)


async def test_caches_filled_and_frame_buffers_reused(host: ModelHost, model: Path) -> None:
    fake = await start_fake_prefill(model, TOKEN, "zeros")
    pool = BufferPool()
    made: list[bytearray] = []  # kept alive: their ids stay distinct
    take = pool.take

    def counting_take(n: int) -> bytearray:
        buffer = take(n)
        made.append(buffer)
        return buffer

    pool.take = counting_take  # type: ignore[method-assign]
    try:
        events = EventBus()
        for _ in range(3):
            caches = await host.thread.call(host.new_cache)
            call = PrefillCall("r1", list(range(1, 40)), 0)
            result = await client(host, model, pool, fake.url)(fake.url, call, caches, events)
            assert result.tokens == 39 and result.kv_bytes > 0
            assert [c.offset for c in caches] == [39, 39]
            assert all(not mx.any(c.keys[..., :39, :]).item() for c in caches)  # zeros sent
    finally:
        await fake.close()
    assert fake.signed == ["/v1/prefill"] * 3 and not fake.auth_headers  # never the token
    assert len(made) == 3 * 2  # a buffer per layer frame...
    assert len({id(b) for b in made}) <= 2  # ...the same ones again: given back once applied
    links = [e for e in events.replay(since=0) if isinstance(e, LinkEvent)]
    assert len(links) == 3 * 2 and all(e.name == "net_in" and e.seconds >= 0 for e in links)


def test_buffer_pool() -> None:
    pool = BufferPool(keep_bytes=3000)
    a = pool.take(1000)
    assert len(a) == 1000
    pool.give(memoryview(a)[:1000])
    assert pool.take(400) is not a  # more than twice the need: not handed out
    assert pool.take(900) is a  # a little longer than asked: reused
    b, c, d = pool.take(1000), pool.take(1000), pool.take(1000)
    for buffer in (a, b, c, d):
        pool.give(memoryview(buffer))
    assert {id(pool.take(1000)) for _ in range(4)} & {id(d)} == set()  # over keep_bytes: dropped
    pool.give(memoryview(b"not ours"))  # bytes are never handed out again


@pytest.mark.parametrize("mode", ["503", "409", "error_frame", "garbage", "die", "hang"])
async def test_failures_raise_remote_prefill_error(host: ModelHost, model: Path, mode: str) -> None:
    fake = await start_fake_prefill(model, TOKEN, mode)
    try:
        with pytest.raises(RemotePrefillError) as e:
            await _prefill(host, model, fake.url, BufferPool(), timeout_s=1.0)
    finally:
        await fake.close()
    assert (e.value.retry_after == 1.0) == (mode == "503")


async def test_a_call_without_a_bus_runs_quiet(host: ModelHost, model: Path) -> None:
    fake = await start_fake_prefill(model, TOKEN, "zeros")
    try:
        caches = await host.thread.call(host.new_cache)
        call = PrefillCall("probe", list(range(1, 9)), 0)
        result = await client(host, model, BufferPool(), fake.url)(fake.url, call, caches)
    finally:
        await fake.close()
    assert result.tokens == 8 and [c.offset for c in caches] == [8, 8]
