"""The streaming loop's host side on a CPU (issue 17): host memory taken once at its exact
size, reads in flight that land the same bytes, and the page cache left clean after."""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tandem.nodes.model.index import ModelIndex, load_index
from tandem.nodes.prefill.engine import PrefillEngine
from tandem.nodes.prefill.planning.loads import DIRECT_ALIGN
from tandem.nodes.prefill.planning.plan import make_plan
from tandem.nodes.prefill.stream import reads
from tandem.nodes.prefill.stream.host import HostArena, HostTier, aligned_empty
from tandem.nodes.prefill.stream.reads import open_direct, read_load

from tests.conftest import MakeTiny
from tests.test_streaming_loop import index as index  # a fixture
from tests.test_streaming_loop import model_bytes

# ---------------------------------------------------------------- host memory, taken once


def test_arena_takes_exact_aligned_pieces_once() -> None:
    arena = HostArena([1000, 5000, 3])
    assert arena.nbytes == 3 * DIRECT_ALIGN + DIRECT_ALIGN  # each piece rounded to a block
    assert arena.pinned_bytes == 0  # nothing is pinned without CUDA
    pieces = [arena.take(n) for n in (1000, 5000, 3)]
    assert [p.numel() for p in pieces] == [1000, 5000, 3]
    assert all(p.data_ptr() % DIRECT_ALIGN == 0 for p in pieces)
    starts = [p.data_ptr() for p in pieces]
    assert starts == sorted(starts) and starts[1] - starts[0] == DIRECT_ALIGN
    with pytest.raises(ValueError, match="cannot hand out"):
        arena.take(1)
    arena.close()


class FakeCudart:
    """torch.cuda.cudart()'s two calls the arena makes, recorded (no CUDA here)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # pointer → bytes
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr))
        if ptr in self.registered:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 713  # not registered


def test_a_pinned_arena_is_unregistered_once_closed_or_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory freed while still registered with CUDA makes the next registration at that
    address fail (712), mid-request: an arena unpins on close, and when dropped unclosed."""
    import gc

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    arena = HostArena([1 << 20], pin=True)
    assert arena.pinned_bytes == DIRECT_ALIGN * (-(-(1 << 20) // DIRECT_ALIGN))
    arena.close()
    arena.close()  # once
    assert not fake.registered and [c for c, _ in fake.calls] == ["register", "unregister"]
    dropped = HostArena([1 << 20], pin=True)
    assert len(fake.registered) == 1
    del dropped
    gc.collect()
    assert not fake.registered  # unpinned before its memory went back


def test_host_tier_is_one_arena_of_its_members(index: ModelIndex) -> None:
    """The tier takes exactly its members' bytes up front (block-rounded, never a power of
    two), and a member's buffer is the same memory every pass."""
    plan = make_plan(index, model_bytes(index) // 3, direct=True)
    streamed = [ld for ld in plan.loads if not ld.resident]
    budget = sum(ld.nbytes for ld in streamed[:3]) + 10
    tier = HostTier(streamed, budget)
    members = [ld for ld in streamed if ld.seq in tier.members]
    assert len(members) == 3 and members[0] == streamed[0]  # spread evenly (plan.host_set)
    assert tier._arena.nbytes == sum(-(-ld.nbytes // DIRECT_ALIGN) * DIRECT_ALIGN for ld in members)
    first, held = tier.buffer(streamed[0])
    assert first is not None and not held
    assert tier.buffer(streamed[0])[0].data_ptr() == first.data_ptr()
    other = next(ld for ld in streamed if ld.seq not in tier.members)
    assert tier.buffer(other) == (None, False)
    tier.close()


# ---------------------------------------------------------------- reads


@pytest.mark.parametrize("direct", [True, False])
def test_reads_in_flight_land_the_same_bytes(
    index: ModelIndex, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a pool of readers and O_DIRECT spans cut into many small reads, every load lands
    exactly the bytes of one read at a time through the page cache."""
    monkeypatch.setattr(reads, "READ_CHUNK", 2 * DIRECT_ALIGN)
    plan = make_plan(index, model_bytes(index) // 3, direct=direct)
    files = [str(f) for f in index.files]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    direct_fds = open_direct(files)
    if direct and not direct_fds:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        with ThreadPoolExecutor(reads.READ_THREADS) as pool:
            for ld in plan.loads:
                want = aligned_empty(ld.nbytes).fill_(0)
                got = aligned_empty(ld.nbytes).fill_(0)
                assert read_load(fds, ld, want) == ld.weight_bytes
                assert read_load(fds, ld, got, direct_fds, pool) == ld.weight_bytes
                for piece, off in zip(ld.pieces, ld.offsets, strict=True):  # not the padding
                    end = off + piece.nbytes
                    assert torch.equal(want[off:end], got[off:end]), piece.key
    finally:
        for fd in [*fds.values(), *direct_fds.values()]:
            os.close(fd)


def _cached_pages(path: str, offset: int, length: int) -> tuple[int, int]:
    """(pages of the range in the page cache, pages in the range), by mincore(2)."""
    page = mmap.PAGESIZE
    lo = offset // page * page
    n = offset + length - lo
    pages = -(-n // page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(n))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), pages


def test_weights_read_through_the_page_cache_are_dropped_after(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a host tier nothing keeps the streamed weights in the page cache: a model
    larger than RAM would otherwise evict exactly the pages needed next. (A model of its
    own: no other test's reads are in its files' cache.)"""
    index = load_index(tiny_model(layers=3, hidden=256, heads=4, kv_heads=2, intermediate=768))
    monkeypatch.setattr(reads, "open_direct", lambda files: {})  # all through the cache
    for f in index.files:  # start from a cold cache: what is cached after, the pass left
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    engine = PrefillEngine(index, budget=model_bytes(index) // 3, device="cpu")
    try:
        list(engine.prefill(list(range(50))))
    finally:
        engine.close()
    cached = total = 0
    for ld in engine.plan.loads:
        if ld.resident:
            continue
        for piece in ld.pieces:
            c, t = _cached_pages(str(piece.entry.file), *piece.span())
            cached, total = cached + c, total + t
    if total == 0:
        pytest.skip("nothing streamed")
    assert cached <= 0.05 * total, f"{cached} of {total} pages still cached"
