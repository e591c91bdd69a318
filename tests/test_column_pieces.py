"""Column pieces: `Piece.cols`, a range of a tensor's last dim (a tensor-parallel rank's share
of o_proj or down_proj), read by a strided copy into slot memory laid out as its shape, beside
whole tensors, row ranges and O_DIRECT spans in one load; through the movers, the delayed one
and the RAM tier; touching only its own pages of the file."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tandem.nodes.model.index import TensorEntry
from tandem.nodes.model.safetensors_format import RawTensor, encode, read_header
from tandem.nodes.prefill.planning.loads import (
    DIRECT_MIN,
    Load,
    Part,
    Piece,
    Runs,
    direct_span,
    landing,
    layout,
)
from tandem.nodes.prefill.planning.plan import Plan
from tandem.nodes.prefill.stream import reads
from tandem.nodes.prefill.stream.delayed import DelayedMover
from tandem.nodes.prefill.stream.host import HostTier, aligned_empty
from tandem.nodes.prefill.stream.movers import CpuMover, Mover
from tandem.nodes.prefill.stream.reads import PAGE, Reader, open_direct, page_ranges, read_load
from tandem.nodes.prefill.stream.streamer import LayerStreamer, part_weights

from tests.test_streaming_loop_host import _cached_pages

Entries = dict[str, TensorEntry]


def _tensors() -> dict[str, tuple[str, torch.Tensor]]:
    """name → (safetensors dtype, tensor): float32 and bf16 matrices, an MLX-style 4-bit one
    (4096 columns packed in 512 uint32 words, scales and biases per group of 64), stacked
    experts, a vector, and a matrix whose rows are 64 KiB (a page of columns is one row's
    sixteenth)."""
    g = torch.Generator().manual_seed(0)

    def f32(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "f32": ("F32", f32(64, 1024)),
        "bf16": ("BF16", f32(64, 1024).to(torch.bfloat16)),
        "packed": ("U32", torch.randint(-(2**31), 2**31 - 1, (64, 512), generator=g).int()),
        "scales": ("BF16", f32(64, 64).to(torch.bfloat16)),
        "biases": ("BF16", f32(64, 64).to(torch.bfloat16)),
        "experts": ("F32", f32(4, 32, 256)),
        "bias": ("F32", f32(1024)),
        "norm": ("F32", f32(100)),
        "wide": ("F32", f32(16, 16384)),
    }


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Entries, dict[str, torch.Tensor]]:
    """One safetensors file of `_tensors`: its entries and the tensors themselves."""
    made = _tensors()
    path = tmp_path_factory.mktemp("columns") / "model.safetensors"
    raw = {k: RawTensor(d, tuple(t.shape), t.view(torch.uint8).numpy().tobytes())
           for k, (d, t) in made.items()}  # fmt: skip
    path.write_bytes(encode(raw))
    with open(path, "rb") as f:
        header, _, start = read_header(f)
    entries = {k: TensorEntry(k, h.dtype, h.shape, path, start + h.begin, h.end - h.begin)
               for k, h in header.items()}  # fmt: skip
    return entries, {k: t for k, (_, t) in made.items()}


def _pieces(e: Entries) -> list[Piece]:
    """Column ranges (and rows with columns) beside whole tensors and row ranges, some of them
    big enough for O_DIRECT spans of their own."""
    return [
        Piece("whole", e["f32"]),  # 256 KiB: O_DIRECT in a direct layout
        Piece("f32.cols", e["f32"], cols=(256, 768)),  # 128 KiB, but strided: never O_DIRECT
        Piece("norm", e["norm"]),
        Piece("f32.rows_cols", e["f32"], rows=(8, 40), cols=(512, 1024)),
        Piece("bf16.cols", e["bf16"], cols=(0, 512)),
        Piece("bf16.rows", e["bf16"], rows=(0, 32)),  # 64 KiB: O_DIRECT too
        Piece("packed.cols", e["packed"], cols=(256, 512)),  # columns 2048..4095 as words
        Piece("scales.cols", e["scales"], cols=(32, 64)),  # ... and as their groups
        Piece("biases.cols", e["biases"], cols=(32, 64)),
        Piece("experts.rows_cols", e["experts"], rows=(1, 3), cols=(64, 192)),
        Piece("bias.cols", e["bias"], cols=(100, 612)),
        Piece("wide.cols", e["wide"], cols=(0, 1024)),
        Piece("wide.mid", e["wide"], cols=(8192, 9216)),  # the file's last bytes are not its
    ]


def _want(piece: Piece, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    t = tensors[piece.entry.name]
    if piece.rows is not None:
        t = t[piece.rows[0] : piece.rows[1]]
    if piece.cols is not None:
        t = t[..., piece.cols[0] : piece.cols[1]]
    return t.contiguous()


def _load(seq: int, pieces: list[Piece], direct: bool, resident: bool = False) -> Load:
    offsets, size = layout(pieces, direct)
    part = Part(seq, "o", 0, 1, True, True, tuple(pieces))
    return Load(seq, seq, (part,), tuple(offsets), size, True, True, resident, direct)


def _check_bytes(load: Load, dest: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        want = _want(piece, tensors)
        assert tuple(want.shape) == piece.shape, piece.key
        assert torch.equal(dest[off : off + piece.nbytes], want.view(-1).view(torch.uint8)), (
            piece.key
        )


# ---------------------------------------------------------------- the piece


def test_a_column_piece_is_its_shape_in_strided_runs(
    weights: tuple[Entries, dict[str, torch.Tensor]],
) -> None:
    e, _ = weights
    f32 = e["f32"]  # [64, 1024] float32: lines of 4096 bytes
    cols = Piece("o", f32, cols=(256, 768))
    assert cols.shape == (64, 512) and cols.nbytes == 64 * 512 * 4 and cols.strided
    assert cols.runs() == Runs(f32.offset + 256 * 4, 512 * 4, 4096, 64)
    assert cols.span() == (f32.offset + 1024, 63 * 4096 + 2048)  # the range its runs enclose
    both = Piece("o", f32, rows=(8, 40), cols=(512, 1024))
    assert both.shape == (32, 512)
    assert both.runs() == Runs(f32.offset + 8 * 4096 + 2048, 2048, 4096, 32)
    experts = Piece("e", e["experts"], rows=(1, 3), cols=(64, 192))  # [4, 32, 256]: 1 KiB lines
    assert experts.shape == (2, 32, 128) and experts.nbytes == 2 * 32 * 128 * 4
    assert experts.runs() == Runs(e["experts"].offset + 32 * 1024 + 256, 512, 1024, 64)
    packed = Piece("w", e["packed"], cols=(256, 512))
    assert packed.shape == (64, 256) and packed.nbytes == 64 * 256 * 4

    # one run after all: a vector's range, every column, a single row
    for one in (
        Piece("b", e["bias"], cols=(100, 612)),
        Piece("o", f32, rows=(3, 9), cols=(0, 1024)),
        Piece("o", f32, rows=(5, 6), cols=(10, 20)),
    ):
        assert not one.strided and one.span() == (one.runs().first, one.nbytes)
    assert Piece("b", e["bias"], cols=(100, 612)).span() == (e["bias"].offset + 400, 2048)
    with pytest.raises(ValueError, match="columns"):
        Piece("o", f32, cols=(0, 1025))
    with pytest.raises(ValueError, match="columns"):
        Piece("o", f32, cols=(8, 8))
    with pytest.raises(ValueError, match="1-D"):
        Piece("b", e["bias"], rows=(0, 4), cols=(0, 2))


def test_a_direct_layout_gives_a_column_piece_no_o_direct_span(
    weights: tuple[Entries, dict[str, torch.Tensor]],
) -> None:
    load = _load(0, _pieces(weights[0]), direct=True)
    spans = {p.key: direct_span(p, o) for p, o in zip(load.pieces, load.offsets, strict=True)}
    assert spans["whole"] is not None and spans["bf16.rows"] is not None
    for piece in load.pieces:
        if piece.strided:
            assert piece.nbytes < DIRECT_MIN or spans[piece.key] is None, piece.key
    assert spans["f32.cols"] is None  # big enough, but many runs
    for piece, off in zip(load.pieces, load.offsets, strict=True):
        if piece.strided:  # read where it stays: no move after the read
            assert landing(piece, off, True) == off, piece.key


# ---------------------------------------------------------------- reads


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("threads", [False, True])
def test_read_load_puts_each_column_slice_at_its_offset(
    weights: tuple[Entries, dict[str, torch.Tensor]],
    direct: bool,
    threads: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Column pieces in one load with whole tensors, row ranges and O_DIRECT spans: each
    piece's bytes are exactly `tensor[rows][..., c0:c1]`; with threads, cut into many reads."""
    e, tensors = weights
    if threads:
        monkeypatch.setattr(reads, "READ_CHUNK", 16 << 10)  # a column piece: several reads
    load = _load(0, _pieces(e), direct)
    files = [str(e["f32"].file)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    direct_fds = open_direct(files) if direct else None
    if direct and not direct_fds:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        with ThreadPoolExecutor(reads.READ_THREADS) as pool:
            dest = aligned_empty(load.nbytes).fill_(0xAB)
            got = read_load(fds, load, dest, direct_fds, pool if threads else None)
    finally:
        for fd in [*fds.values(), *(direct_fds or {}).values()]:
            os.close(fd)
    assert got == load.weight_bytes
    _check_bytes(load, dest, tensors)


def test_the_reader_maps_each_file_once_and_prefetches_only_column_pages(
    weights: tuple[Entries, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefetch` asks the kernel for a column piece's own pages, not the enclosing range
    (which would read every other column too); the reader keeps one mapping per file, closed
    with it."""
    e, tensors = weights
    wide = Piece("wide.cols", e["wide"], cols=(0, 1024))  # 4 KiB of each 64 KiB row
    load = _load(0, [wide, Piece("f32.cols", e["f32"], cols=(0, 512))], direct=True)
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, n: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, n))
        real(fd, offset, n, advice)

    reader = Reader([str(e["wide"].file)], direct=True)
    try:
        monkeypatch.setattr(os, "posix_fadvise", spy)
        reader.prefetch(load, None)
        monkeypatch.setattr(os, "posix_fadvise", real)
        start, n = wide.span()
        within = [
            min(o + k, start + n) - max(o, start)
            for o, k in asked
            if o < start + n and o + k > start
        ]
        assert n > 15 * (64 << 10)  # the enclosing range: nearly the whole matrix
        assert wide.nbytes <= sum(within) <= 16 * 2 * PAGE  # each row: its run's page or two
        for _ in range(2):
            dest = aligned_empty(load.nbytes).fill_(0)
            assert reader.read(load, dest, None) == load.weight_bytes
            _check_bytes(load, dest, tensors)
        assert list(reader.maps) == [str(e["wide"].file)]
        mapped = reader.maps[str(e["wide"].file)]
    finally:
        reader.close()
    assert mapped.closed and not reader.maps


def test_a_column_read_touches_only_its_own_pages(
    weights: tuple[Entries, dict[str, torch.Tensor]],
) -> None:
    """From a cold page cache, a column piece's read brings in the pages its runs touch (one
    or two of each row's sixteen), and dropping it leaves none."""
    e, tensors = weights
    wide = Piece("wide.cols", e["wide"], cols=(0, 1024))
    name = str(e["wide"].file)
    fd = os.open(name, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _cached_pages(name, *wide.span())[0]:
            pytest.skip("this file system keeps its pages cached")
        load = _load(0, [wide], direct=False)
        dest = aligned_empty(load.nbytes)
        read_load({name: fd}, load, dest)
        _check_bytes(load, dest, tensors)
        cached, total = _cached_pages(name, *wide.span())
        needed = sum(n for _, n in page_ranges(wide)) // PAGE
        assert needed <= 2 * 16 and total >= 15 * 16
        assert 16 <= cached <= needed, (cached, needed, total)
        reads.drop_from_page_cache({name: fd}, load)
        assert _cached_pages(name, *wide.span())[0] == 0
    finally:
        os.close(fd)


# ---------------------------------------------------------------- through the streamer


def _plan(e: Entries) -> Plan:
    """A resident load and four streamed ones through two slots, column pieces in each."""
    pieces = _pieces(e)
    groups = [pieces[:3], pieces[3:6], pieces[6:9], pieces[9:], [pieces[1], pieces[0]]]
    loads = tuple(_load(i, g, direct=True, resident=i == 0) for i, g in enumerate(groups))
    slot = max(ld.nbytes for ld in loads if not ld.resident)
    return Plan(loads, (0,), n_slots=2, slot_bytes=slot, budget_bytes=8 * slot)


MOVERS: dict[str, Callable[[list[str], HostTier | None], Mover]] = {
    "cpu": lambda files, tier: CpuMover(files, None, torch.device("cpu"), tier),
    "delayed": lambda files, tier: DelayedMover(files, torch.device("cpu"), None, tier),
}


def _passes(streamer: LayerStreamer, n: int) -> Iterator[dict[str, torch.Tensor]]:
    for _ in range(n):
        with streamer.stream(route=False) as run:
            for load, views in run:
                yield {f"{load.seq}:{k}": v.clone() for k, v in part_weights(views, "o", 0).items()}


@pytest.mark.parametrize("tier", [False, True])
@pytest.mark.parametrize("mover", list(MOVERS))
def test_the_streamer_yields_column_slices(
    weights: tuple[Entries, dict[str, torch.Tensor]], mover: str, tier: bool
) -> None:
    """Every view a pass yields is its column slice, with the plain mover, with copies landing
    late (`DelayedMover`), and from the RAM tier (read once, then copied from RAM)."""
    e, tensors = weights
    plan = _plan(e)
    streamed = [ld for ld in plan.loads if not ld.resident]
    ram = HostTier(streamed, sum(ld.nbytes for ld in streamed[:2])) if tier else None
    streamer = LayerStreamer(plan, MOVERS[mover]([str(e["f32"].file)], ram))
    try:
        seen = list(_passes(streamer, 2 if tier else 1))
        disk = streamer.last_stats.disk_bytes
    finally:
        streamer.close()
    by_seq = {ld.seq: ld for ld in plan.loads}
    for views in seen:
        for key, got in views.items():
            seq, name = key.split(":", 1)
            piece = next(p for p in by_seq[int(seq)].pieces if p.key == name)
            assert torch.equal(got, _want(piece, tensors).view(got.dtype)), key
    assert sum(len(v) for v in seen) == (2 if tier else 1) * len(
        [p for ld in plan.loads for p in ld.pieces]
    )
    if ram is not None:  # the second pass: the tier's loads from RAM, the rest from disk
        assert 0 < len(ram.members) < len(streamed)
        assert disk == sum(ld.weight_bytes for ld in streamed if ld.seq not in ram.members)
