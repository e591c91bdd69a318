"""Host memory for the movers: `HostArena`, one block taken up front and pinned once, and
`HostTier`, the loads kept in system RAM across requests.

Host memory that a copy reads from (staging, host tier) is one `HostArena` per use, taken up
front at its exact size and pinned once (`cudaHostRegister`): torch's pinned allocator rounds
every request up to a power of two, allocates on first use (an implicit device sync, and a
failure mid-request) and keeps what it took.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from typing import Any

import torch
from tandem.nodes.prefill.planning.loads import DIRECT_ALIGN, Load, Part
from tandem.nodes.prefill.planning.plan import Plan, host_set
from tandem.nodes.prefill.planning.ram import HostBudget, tier_bytes

log = logging.getLogger(__name__)


class PinError(RuntimeError):
    """Host memory could not be pinned (at start-up: never halfway through a request)."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class HostArena:
    """One block of host memory, taken up front and handed out in `DIRECT_ALIGN`-aligned
    pieces (O_DIRECT reads land in them). With `pin`, registered with CUDA once, at exactly
    its size: `pinned_bytes` is what is really pinned."""

    def __init__(self, sizes: list[int], pin: bool = False) -> None:
        total = sum(_round_up(n, DIRECT_ALIGN) for n in sizes)
        self._mem = aligned_empty(total)
        self._cursor = 0
        self.nbytes = total
        self.pinned_bytes = 0
        self._unpin: weakref.finalize | None = None
        if pin and total:
            code = int(torch.cuda.cudart().cudaHostRegister(self._mem.data_ptr(), total, 0))
            if code != 0:
                raise PinError(
                    f"cannot pin {total / 2**30:.2f} GiB of host memory for staging and the host"
                    f" tier (cudaError {code}); lower --host-budget or --budget"
                )
            self.pinned_bytes = total
            # unregistered before the memory goes back, even for an arena never closed: freed
            # memory left registered makes the next registration at that address fail
            self._unpin = weakref.finalize(self, _unregister, self._mem)

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the arena (uint8, aligned)."""
        start = self._cursor
        end = start + _round_up(nbytes, DIRECT_ALIGN)
        if end > self.nbytes:
            raise ValueError(f"host arena of {self.nbytes} B cannot hand out {nbytes} B more")
        self._cursor = end
        return self._mem[start : start + nbytes]

    def close(self) -> None:
        """Unpin (once); the caller has made sure no copy into or out of it is in flight."""
        if self._unpin is not None:
            self._unpin()
        self.pinned_bytes = 0


def _unregister(mem: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(mem.data_ptr()))
    if code != 0:
        log.warning("cudaHostUnregister of %d B failed (cudaError %d)", mem.numel(), code)


class HostTier:
    """Loads kept in host memory across requests (`--host-budget`, sized by `ram.tier_bytes`):
    VRAM first, system RAM second, disk last. A fixed set chosen up front (`plan.host_set`:
    spread evenly through the cycle) — the access is cyclic, so never LRU. A member is
    read from disk once, on the first pass, and copied from RAM after that; a routed member
    expert by expert, as its tokens choose them (short prompts fill it too, issue 48: it was
    kept only once a pass read it whole, and a node serving short prompts read every chosen
    expert from disk each pass). Everything else is
    read from disk each pass and dropped from the page cache right after
    (`POSIX_FADV_DONTNEED`), so the weights do not crowd out the tier or thrash the cache."""

    def __init__(self, loads: list[Load], budget: int, pin: bool = False) -> None:
        self.budget = budget
        self.members: set[int] = set(host_set(loads, budget))
        chosen = [ld for ld in loads if ld.seq in self.members]
        self.bytes = sum(ld.nbytes for ld in chosen)
        self._arena = HostArena([ld.nbytes for ld in chosen], pin)  # all of it now, pinned once
        self._buffers = {ld.seq: self._arena.take(ld.nbytes) for ld in chosen}
        self._held: dict[int, set[Part]] = {}  # per member: the parts its buffer holds whole

    @property
    def pinned_bytes(self) -> int:
        return self._arena.pinned_bytes

    def buffer(self, load: Load) -> tuple[torch.Tensor | None, bool]:
        """(host buffer for a member load or None, whether it already holds all of `load`:
        the whole load, or a routed load's chosen experts)."""
        buf = self._buffers.get(load.seq)
        held = buf is not None and set(load.parts) <= self._held.get(load.seq, set())
        return buf, held

    def missing(self, load: Load) -> Load:
        """What of a member `load` its buffer does not hold yet: the read it needs (its
        parts land where the whole load's would: `loads.landing`)."""
        held = self._held.get(load.seq, set())
        keep = [part for part in load.parts if part not in held]
        if len(keep) == len(load.parts):
            return load
        places = iter(load.offsets)
        placed = {part: [next(places) for _ in part.pieces] for part in load.parts}
        offsets = tuple(o for part in keep for o in placed[part])
        return replace(load, parts=tuple(keep), offsets=offsets, partial=True)

    def staged(self, load: Load, reader: Any) -> tuple[torch.Tensor | None, int]:
        """A member `load`'s buffer holding all of it, as landed (what it lacked read now,
        `reader` a `reads.Reader`), and the bytes read from disk; (None, 0) for a load that
        is not the tier's."""
        buf, held = self.buffer(load)
        if buf is None or held:
            return buf, 0
        disk = reader.read(self.missing(load), buf, self, settle=False)
        self.hold(load)
        return buf, disk

    def hold(self, load: Load) -> None:
        """The load's buffer now holds `load`'s parts: called only once its read has
        succeeded, so a read that failed halfway is read again next time, never used as
        weights."""
        if load.seq in self.members:
            self._held.setdefault(load.seq, set()).update(load.parts)

    def close(self) -> None:
        self._buffers.clear()
        self._held.clear()
        self._arena.close()


def host_tier(
    plan: Plan, budget: HostBudget | None, beside: int, pin: bool = False
) -> tuple[Plan, HostTier | None]:
    """The plan with its RAM tier (`Plan.host_loads`) and the tier itself, or (plan, None)
    where there is none. `budget`: bytes, `"auto"` (what RAM can spare: `ram.tier_bytes`) or
    0/None (off); `beside`: what the node takes from RAM besides the tier. On a CPU the
    device is RAM, and `auto` still keeps a second copy of the streamed set there when RAM can
    spare it beside the budget: the budget bounds what the compute works on, the tier is what
    the page cache would have held had O_DIRECT not bypassed it. Where `auto` cannot pin its
    tier, the node runs without one; a size asked for raises `PinError`."""
    streamed = [ld for ld in plan.loads if not ld.resident]
    size = tier_bytes(budget, sum(ld.nbytes for ld in streamed), beside)
    if not size:
        return plan, None
    try:
        tier = HostTier(streamed, size, pin)
    except PinError as e:
        if budget != "auto":
            raise  # a size asked for: the node does not start without it
        log.warning("no RAM tier: %s", e)  # auto: the disk, as with --host-budget 0
        return plan, None
    plan = plan.with_host(size)
    log.info(
        "RAM tier: %d of %d streamed loads, %d B%s", len(tier.members), len(streamed),
        tier.bytes, " pinned" if pin else "",
    )  # fmt: skip
    return plan, tier


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """uint8 host memory whose first byte is `DIRECT_ALIGN`-aligned (O_DIRECT's rule)."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]
