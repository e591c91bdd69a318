"""The prefix cache's host memory on CUDA: blocks pinned once, that its entries are carved
from, so that a request's prefix uploads from where the cache keeps it, without blocking and
with no new pinning (issue 48 item 9: each request pinned a copy of its whole prefix).

torch's pinned allocator rounds each request up to a power of two and keeps what it took:
each block is taken at its exact size and registered with CUDA once (as `HostArena` does),
from its storage's first byte, where `Tensor.is_pinned` asks. The blocks come as the cache
fills, `BLOCK_BYTES` at a time up to the cache's size: a node that keeps little pins little,
and no request waits for the whole cache to be pinned. Pieces are found first fit in each
block's free runs; a piece given back merges with the free runs beside it.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import Any

import torch
from tandem.nodes.prefill.stream.host import PinError

log = logging.getLogger(__name__)

ALIGN = 256  # bytes: where each piece and each tensor in it starts (any dtype's view)
BLOCK_BYTES = 1 << 30  # a block pinned at a time (more where one piece needs it)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Block:
    """One block of host memory and its free runs: (address, bytes), in address order."""

    def __init__(self, nbytes: int) -> None:
        self.mem = torch.empty(nbytes, dtype=torch.uint8)  # the storage's own start
        self.start = self.mem.data_ptr()
        self.free = [(self.start, nbytes)]

    def alloc(self, size: int) -> int | None:
        for i, (at, room) in enumerate(self.free):
            if room >= size:
                self.free[i : i + 1] = [(at + size, room - size)] if room > size else []
                return at
        return None

    def give_back(self, at: int, size: int) -> None:
        i = bisect.bisect(self.free, (at, 0))
        if i < len(self.free) and self.free[i][0] == at + size:  # the run after it
            size += self.free.pop(i)[1]
        if i and sum(self.free[i - 1]) == at:  # the run before it
            i -= 1
            at, size = self.free[i][0], self.free[i][1] + size
            del self.free[i]
        self.free.insert(i, (at, size))


class PrefixArena:
    """Host memory of up to `nbytes`, handed out in pieces and taken back (`alloc`/`free`, by
    address); `place` copies tensors into one piece. With `pin`, each block is registered
    with CUDA at its exact size as it is taken: `pinned_bytes`."""

    def __init__(self, nbytes: int, pin: bool = False, block_bytes: int = BLOCK_BYTES) -> None:
        self.nbytes = _round_up(max(nbytes, 0))
        self.pin = pin
        self.block_bytes = _round_up(block_bytes)
        self.pinned_bytes = 0
        self._blocks: list[_Block] = []
        self._used: dict[int, int] = {}  # address → bytes, of the pieces handed out
        self._unpin: list[weakref.finalize] = []

    @property
    def taken_bytes(self) -> int:
        """Bytes of the blocks taken so far."""
        return sum(b.mem.numel() for b in self._blocks)

    @property
    def free_bytes(self) -> int:
        """What more can be handed out: free runs, and blocks not taken yet."""
        return self.nbytes - sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """The address of a free piece of `nbytes` (rounded to `ALIGN`): first fit in the
        blocks taken, else in a new block where the cache's size leaves room; else None."""
        size = _round_up(max(nbytes, 1))
        for block in self._blocks:
            if (at := block.alloc(size)) is not None:
                self._used[at] = size
                return at
        room = self.nbytes - self.taken_bytes
        if size > room:
            return None
        try:
            block = self._take(min(room, max(size, self.block_bytes)))
        except PinError as e:  # what is pinned serves; the rest of the cache stays pageable
            log.warning("the prefix cache stops at %d B pinned: %s", self.taken_bytes, e)
            self.nbytes = self.taken_bytes
            return None
        at = block.alloc(size)
        assert at is not None
        self._used[at] = size
        return at

    def free(self, at: int) -> None:
        """The piece at address `at` back, merged with the free runs beside it."""
        size = self._used.pop(at)
        next(b for b in self._blocks if b.start <= at < b.start + b.mem.numel()).give_back(at, size)

    def place(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Copies of `tensors` side by side in one new piece, by name, the first at the piece's
        start (`piece_of`); None where no free run holds them."""
        sizes = [_round_up(t.nbytes) for t in tensors.values()]
        at = self.alloc(sum(sizes))
        if at is None:
            return None
        block = next(b for b in self._blocks if b.start <= at < b.start + b.mem.numel())
        offset, out = at - block.start, {}
        for (name, t), size in zip(tensors.items(), sizes, strict=True):
            out[name] = block.mem[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            out[name].copy_(t)
            offset += size
        return out

    def piece_of(self, t: torch.Tensor) -> int | None:
        """The address of the piece that `t` starts (its first tensor), else None."""
        at = t.data_ptr()
        return at if at in self._used else None

    def close(self) -> None:
        """Unpin (once); the caller has made sure no copy out of it is in flight."""
        for unpin in self._unpin:
            unpin()
        self.pinned_bytes = 0

    def _take(self, nbytes: int) -> _Block:
        block = _Block(nbytes)
        if self.pin:
            cudart = torch.cuda.cudart()
            code = int(cudart.cudaHostRegister(block.start, nbytes, 0))
            if code != 0:
                raise PinError(f"cannot pin {nbytes} B for the prefix cache (cudaError {code})")
            self.pinned_bytes += nbytes
            # unregistered before the memory goes back (the finalizer holds it), even for an
            # arena never closed: freed memory left registered fails the next registration there
            self._unpin.append(weakref.finalize(self, _unregister, cudart, block.mem))
        self._blocks.append(block)
        return block


def _unregister(cudart: Any, mem: torch.Tensor) -> None:
    code = int(cudart.cudaHostUnregister(mem.data_ptr()))
    if code != 0:
        log.warning("cudaHostUnregister of the prefix cache failed (cudaError %d)", code)
