"""The prefix cache's pinned arena (issue 48 item 9): pieces carved from one block and taken
back, the cache's entries kept in it (unpinned here, the same carving), held while a pass reads
them, and a real engine's turns through `reusing` with the entries in the arena."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import pytest
import torch
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.prefix_upload import Prefix, PrefixUpload
from tandem.nodes.prefill.serving.prefix_arena import ALIGN, PrefixArena
from tandem.nodes.prefill.serving.prefix_cache import PrefixCache, reusing

from tests.test_qwen3_5_prefill import run
from tests.test_qwen3_5_prefill_cache import EDITED, FIRST, TOKENS, _assert_same, _turn
from tests.test_qwen3_5_prefill_cache import engine as engine  # a fixture
from tests.test_streaming_loop_host import FakeCudart


def test_pieces_are_carved_first_fit_and_merge_when_given_back() -> None:
    arena = PrefixArena(8 * ALIGN)
    a, b, c = arena.alloc(1), arena.alloc(2 * ALIGN), arena.alloc(ALIGN + 1)
    assert a is not None and (b, c) == (a + ALIGN, a + 3 * ALIGN)  # each rounded, side by side
    assert arena.alloc(4 * ALIGN) is None and arena.free_bytes == 3 * ALIGN
    arena.free(b)
    assert arena.alloc(3 * ALIGN) == a + 5 * ALIGN  # the hole of two is too small: after c
    arena.free(a)  # merges with b's hole: three in a row
    assert arena.alloc(3 * ALIGN) == a
    arena.free(a)
    arena.free(c)
    arena.free(a + 5 * ALIGN)  # all of it back, one run again
    assert arena.free_bytes == 8 * ALIGN and arena.alloc(8 * ALIGN) == a
    assert arena.taken_bytes == 8 * ALIGN  # one block: the arena is smaller than BLOCK_BYTES


def test_blocks_are_taken_as_the_arena_fills_up_to_its_size() -> None:
    arena = PrefixArena(10 * ALIGN, block_bytes=4 * ALIGN)
    assert arena.taken_bytes == 0  # nothing before the first piece
    first = arena.alloc(3 * ALIGN)
    assert first is not None and arena.taken_bytes == 4 * ALIGN
    second = arena.alloc(3 * ALIGN)  # not in the first block's one free run: a second block
    assert second is not None and arena.taken_bytes == 8 * ALIGN
    assert arena.alloc(ALIGN) == first + 3 * ALIGN  # first fit, in the first block
    assert arena.alloc(3 * ALIGN) is None  # only 2 * ALIGN left to take
    big = arena.alloc(2 * ALIGN)  # the last block: what the size leaves
    assert big is not None and arena.taken_bytes == 10 * ALIGN and arena.free_bytes == ALIGN
    arena.free(second)
    assert arena.alloc(3 * ALIGN) == second  # reused, no block more
    assert PrefixArena(10 * ALIGN, block_bytes=2 * ALIGN).alloc(5 * ALIGN) is not None  # one
    # piece larger than a block: a block of its size


def test_place_copies_tensors_into_one_piece_and_knows_its_start() -> None:
    arena = PrefixArena(4096)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4).to(torch.bfloat16)
    placed = arena.place({"k": k, "v": v})
    assert placed is not None and torch.equal(placed["k"], k) and torch.equal(placed["v"], v)
    assert placed["v"].dtype == torch.bfloat16 and placed["k"].is_contiguous()
    start = placed["k"].data_ptr()
    assert placed["k"].untyped_storage().data_ptr() == start  # the block's first piece
    assert placed["v"].data_ptr() == start + ALIGN
    assert arena.piece_of(placed["k"]) == start and arena.piece_of(placed["v"]) is None
    assert arena.piece_of(k) is None  # not in the arena
    assert arena.place({"big": torch.empty(4096)}) is None  # 16 KiB: no run holds it


def test_a_pinned_arena_registers_each_block_once_at_its_exact_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registered from the storage's first byte (where `Tensor.is_pinned` asks CUDA) as it is
    taken, unregistered on close, once, or when the arena is dropped unclosed; a block that
    cannot be pinned ends the arena's growth, not the request."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    arena = PrefixArena(10 * ALIGN + 1, pin=True, block_bytes=8 * ALIGN)
    assert not fake.registered
    placed = arena.place({"x": torch.ones(64)})
    assert placed is not None
    storage = placed["x"].untyped_storage()
    assert fake.registered == {storage.data_ptr(): 8 * ALIGN}
    assert storage.nbytes() == 8 * ALIGN and arena.pinned_bytes == 8 * ALIGN
    assert arena.alloc(7 * ALIGN) is not None  # the rest of the first block
    assert arena.alloc(4 * ALIGN) is None  # 3 * ALIGN are left to take
    assert arena.alloc(3 * ALIGN) is not None and arena.pinned_bytes == 11 * ALIGN
    arena.close()
    arena.close()
    assert (
        not fake.registered and [c for c, _ in fake.calls] == ["register"] * 2 + ["unregister"] * 2
    )
    dropped = PrefixArena(ALIGN, pin=True)
    dropped.alloc(1)
    assert len(fake.registered) == 1
    del dropped
    gc.collect()
    assert not fake.registered
    monkeypatch.setattr(fake, "cudaHostRegister", lambda ptr, nbytes, flags: 2)  # out of memory
    refused = PrefixArena(4 * ALIGN, pin=True)
    assert refused.alloc(1) is None and refused.free_bytes == 0 and not fake.registered


def _kv(n: int, fill: float, layers: int = 2) -> list[Prefix]:
    return [(torch.full((1, 2, n, 4), fill + i), torch.full((1, 2, n, 4), -fill - i))
            for i in range(layers)]  # fmt: skip


def _kept(cache: PrefixCache, kv: list[Prefix]) -> list[Prefix]:
    """The layers as a pass hands them to the cache, one by one."""
    out: list[Prefix] = []
    for entry in kv:
        out.append(cache.keep(entry, out))
    return out


def _tensors(kv: Sequence[Prefix]) -> list[torch.Tensor]:
    return [t for layer in kv for t in (layer.values() if isinstance(layer, dict) else layer)]


def _in_arena(cache: PrefixCache, kv: Sequence[Prefix]) -> bool:
    assert cache.arena is not None
    blocks = [(b.start, b.start + b.mem.numel()) for b in cache.arena._blocks]
    return all(any(lo <= t.data_ptr() < hi for lo, hi in blocks) for t in _tensors(kv))


ONE = 2 * 2 * (1 * 2 * 4 * 4 * 4)  # bytes of _kv(4): two layers, K and V of 4 positions


def test_entries_live_in_the_arena_and_their_pieces_are_reused() -> None:
    cache = PrefixCache(max_bytes=2 * ONE + 4 * ALIGN)  # room for the pieces' rounding
    cache.use_arena(pin=False)
    assert cache.arena is not None and cache.arena.pinned_bytes == 0
    first = _kept(cache, _kv(4, 1.0))
    assert _in_arena(cache, first)
    cache.store([1, 2, 3, 4], first)
    j, got = cache.lookup([1, 2, 3, 4, 5])
    assert j == 4 and got is not None and _in_arena(cache, got)
    assert torch.equal(got[1][1], torch.full((1, 2, 4, 4), -2.0))
    cache.store([7, 8, 9, 10], _kept(cache, _kv(4, 7.0)))
    free = cache.arena.free_bytes
    third = _kept(cache, _kv(4, 5.0))  # no room: the least recently used entry goes
    assert _in_arena(cache, third) and cache.lookup([1, 2, 3, 4, 5]) == (0, None)
    assert cache.arena.free_bytes == free  # its pieces, reused
    cache.store([5, 6, 7, 8], third)
    assert cache.nbytes == 2 * ONE
    assert cache.lookup([7, 8, 9, 10, 11])[0] == 4 and cache.lookup([5, 6, 7, 8, 9])[0] == 4


def test_a_held_entry_keeps_its_memory_until_released() -> None:
    """A pass's prefix uploads read the entry it looked up: superseded or not, its pieces are
    handed out again only once the pass lets go; the layers that found no room meanwhile
    move into them when the entry that supersedes it is stored."""
    cache = PrefixCache(max_bytes=ONE + 2 * ALIGN)  # one entry
    cache.use_arena(pin=False)
    assert cache.arena is not None
    cache.store([1, 2, 3, 4], _kept(cache, _kv(4, 1.0)))
    j, held = cache.lookup([1, 2, 3, 4, 5, 6], hold=True)
    assert j == 4 and held is not None
    longer = _kept(cache, _kv(4, 3.0))  # the turn's K/V: the held entry fills the arena
    assert not _in_arena(cache, longer) and torch.equal(held[0][0], torch.full((1, 2, 4, 4), 1.0))
    cache.release(held)  # the turn is done reading it
    cache.store([1, 2, 3, 4, 5, 6], longer)  # supersedes [1, 2, 3, 4], takes its room
    j, got = cache.lookup([1, 2, 3, 4, 5, 6, 7])
    assert j == 6 and got is not None and _in_arena(cache, got)
    assert torch.equal(got[1][0], torch.full((1, 2, 4, 4), 4.0))


def test_a_superseded_held_entry_is_freed_on_release_and_an_unfinished_one_dropped() -> None:
    cache = PrefixCache(max_bytes=3 * ONE)
    cache.use_arena(pin=False)
    assert cache.arena is not None
    empty = cache.arena.free_bytes
    cache.store([1, 2], _kept(cache, _kv(4, 1.0)))
    _, held = cache.lookup([1, 2, 3], hold=True)
    cache.store([1, 2, 3, 4], _kept(cache, _kv(4, 2.0)))  # supersedes the held one
    assert cache.lookup([1, 2, 9])[0] == 2  # [1, 2, 3, 4] cut: the held one is out of the index
    used = cache.arena.free_bytes
    cache.release(held)
    assert cache.arena.free_bytes > used  # its memory, back once released
    unfinished = _kept(cache, _kv(4, 5.0)[:1])  # a pass cancelled after one layer
    cache.drop(unfinished)
    cache.store([1, 2, 3, 4], _kept(cache, _kv(4, 6.0)))  # the same tokens: replaced
    assert cache.nbytes == ONE and cache.arena.free_bytes == empty - 2 * 2 * ALIGN  # K, V a piece


def test_a_request_too_large_for_the_cache_is_not_placed() -> None:
    cache = PrefixCache(max_bytes=ONE * 3 // 4)  # its first layer fits, not both
    cache.use_arena(pin=False)
    kv = _kept(cache, _kv(4, 1.0))
    assert cache.arena is not None and _in_arena(cache, kv[:1]) and not _in_arena(cache, kv[1:])
    cache.store([1, 2, 3, 4], kv)  # not stored: what was placed goes back
    assert cache.nbytes == 0 and cache.arena.free_bytes == cache.arena.nbytes


def test_on_a_cpu_the_cache_keeps_what_it_is_given() -> None:
    cache = PrefixCache()
    kv = _kv(4, 1.0)
    assert all(a is b for a, b in zip(_kept(cache, kv), kv, strict=True)) and cache.arena is None
    cache.store([1, 2, 3, 4], kv)
    _, got = cache.lookup([1, 2, 3, 4, 5], hold=True)
    assert got is not None and got[0][0].data_ptr() == kv[0][0].data_ptr()


@pytest.mark.parametrize("start", [0, FIRST])
def test_turns_through_an_arena_give_a_fresh_prefills_frames(
    engine: PrefillEngine, start: int
) -> None:
    """`test_reusing_gives_a_fresh_prefills_frames` with the entries in an (unpinned) arena:
    Qwen3.5's states and K/V, an extending turn and an edit inside it. Every entry stored is
    the arena's, and every piece that is not an entry's was given back, a cancelled turn's
    too."""
    cache = PrefixCache(max_bytes=64 << 20)
    cache.use_arena(pin=False)
    assert cache.arena is not None
    for tokens, first in ((TOKENS[:FIRST], 0), (TOKENS[:30], start), (EDITED, start)):
        frames, _ = _turn(engine, cache, tokens, first)
        _assert_same(frames, run(engine, tokens), first)
    body = PrefillBody(fingerprint="qwen3_5", request_id="gone", tokens=TOKENS[:36], start=start)
    cancelled = reusing(engine, cache, body)  # reads turn 2's entry, placed two layers
    next(cancelled), next(cancelled)
    cancelled.close()
    entries = [kv for kv, _ in cache._entries.values()]
    assert len(entries) == 3 and all(_in_arena(cache, kv) for kv in entries)
    pieces = sum(-(-t.nbytes // ALIGN) * ALIGN for kv in entries for t in _tensors(kv))
    assert cache.arena.free_bytes == cache.arena.nbytes - pieces


@pytest.mark.cuda
@pytest.mark.parametrize("positions", [40, 30])  # the whole entry; a cut of it, head by head
def test_a_cached_prefix_uploads_from_the_pinned_arena_without_pinning_again(
    monkeypatch: pytest.MonkeyPatch, positions: int
) -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    cache.use_arena(pin=True)
    gen = torch.Generator().manual_seed(0)
    kv: list[Prefix] = [(torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8,
                         generator=gen)) for _ in range(3)]  # fmt: skip
    cache.store(list(range(40)), _kept(cache, kv))
    j, cut = cache.lookup([*range(positions), 99], hold=True)
    assert j == positions and cut is not None and all(t.is_pinned() for t in _tensors(cut))

    def no_pinning(self: torch.Tensor) -> torch.Tensor:
        raise AssertionError("pinned again")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    upload = PrefixUpload(cut, torch.device("cuda"), torch.bfloat16)
    for i, (k, v) in enumerate(kv):
        got = upload.layer(i)
        assert isinstance(got, tuple)
        assert torch.equal(got[0].cpu(), k[:, :, :j].to(torch.bfloat16))
        assert torch.equal(got[1].cpu(), v[:, :, :j].to(torch.bfloat16))
    torch.cuda.synchronize()
    cache.release(cut)
