"""The host tier (`--host-budget`) keeps a load only once its read has succeeded."""

from __future__ import annotations

import errno

import pytest
import torch
from tandem.nodes.model.index import load_index
from tandem.nodes.prefill.planning.plan import make_plan
from tandem.nodes.prefill.stream import reads
from tandem.nodes.prefill.stream.host import HostTier
from tandem.nodes.prefill.stream.movers import CpuMover

from tests.conftest import MakeTiny


def test_a_read_that_fails_halfway_is_read_again_not_used_as_weights(
    tiny_model: MakeTiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = load_index(tiny_model(layers=4))
    plan = make_plan(index, sum(index.layer_bytes(i) for i in range(4)) // 3)
    streamed = [ld for ld in plan.loads if not ld.resident]
    tier = HostTier(streamed, budget=1 << 30)
    mover = CpuMover([str(f) for f in index.files], None, torch.device("cpu"), tier)
    load = streamed[0]
    assert load.seq in tier.members
    region = mover.alloc(plan.slot_bytes)
    good = mover.alloc(plan.slot_bytes)
    plain = CpuMover([str(f) for f in index.files])  # no tier: the true bytes
    plain.fill(0, good, load)
    plain.close()

    real_read = reads.read_load

    def fails_halfway(fds: dict[str, int], ld: object, dest: torch.Tensor, *a: object) -> int:
        dest.fill_(0xAB)  # what a failed read leaves behind
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(reads, "read_load", fails_halfway)
    with pytest.raises(OSError):
        mover.fill(0, region, load)
    monkeypatch.setattr(reads, "read_load", real_read)
    region.zero_()
    times = mover.fill(0, region, load)
    assert times.disk_bytes == load.weight_bytes  # read again from disk, not taken as held
    assert torch.equal(region[: load.nbytes], good[: load.nbytes])
    times = mover.fill(0, region, load)  # now held: served from host memory
    assert times.disk_bytes == 0
    assert torch.equal(region[: load.nbytes], good[: load.nbytes])
    mover.close()
