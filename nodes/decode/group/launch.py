"""Starting a decode group: which rank this process is (`mlx.launch` says so in its
environment: `MLX_RANK`, and for the ring backend `MLX_HOSTFILE`), rank 0's model (the
decode node's, `GroupModel`), and the other ranks' whole life (`follow`).

The backend is whatever `mlx.launch` was given: ring (TCP, Ethernet or Thunderbolt), or
JACCL (Thunderbolt RDMA) where mlx has it; `mx.distributed.init` finds it.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.nodes.decode.group.channel import (
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    GroupLost,
    open_channel,
)
from tandem.nodes.decode.group.follower import Follower
from tandem.nodes.decode.group.mirror import GroupModel, Mirror
from tandem.nodes.decode.group.pipeline import GroupError, Stage, load_stage
from tandem.nodes.decode.group.proof import join
from tandem.nodes.decode.group.split import RankShare
from tandem.nodes.model.spec import load_spec
from tandem.nodes.serve.parent import die_with_parent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupLaunch:
    """What `mlx.launch` told this process."""

    rank: int
    backend: str  # "ring" (a hostfile) or what else mlx finds ("any")
    token: str | None = field(default=None, repr=False)  # the cluster's: each rank proves it


def launched() -> GroupLaunch | None:
    """This process's place in a group `mlx.launch` started; None outside one. A rank never
    outlives the process that started it (`die_with_parent`)."""
    rank = os.environ.get("MLX_RANK")
    if rank is None:
        return None
    die_with_parent()
    backend = "ring" if "MLX_HOSTFILE" in os.environ else "any"
    if "MLX_IBV_DEVICES" in os.environ or "MLX_JACCL_COORDINATOR" in os.environ:
        backend = "jaccl"
    return GroupLaunch(int(rank), backend)


LOST_GRACE_S = 3.0  # a lost group answers 503 (and says why) this long, then the node stops


def init(launch: GroupLaunch) -> Any:
    """The group (`mx.distributed.init` with the backend `mlx.launch` set up), every rank
    proven to hold the cluster token (`proof.join`); GroupError when it is one process only,
    a rank holds another token, or it cannot start."""
    return join(launch.backend, launch.token)


@dataclass
class Rank0:
    """The decode node's side of the group."""

    model: GroupModel
    tokenizer: Any
    shares: list[RankShare]
    backend: str
    lost: str | None = None  # why the group is gone, once a rank is
    on_lost: list[Callable[[str], None]] = field(default_factory=list)  # told `lost`, once

    @property
    def size(self) -> int:
        return len(self.shares)

    def lose(self, why: str) -> str:
        """The group is gone (`why`): every request from now on is a 503 (and `/health` says
        why) for LOST_GRACE_S, then the node stops (its own graceful stop), for `mlx.launch`
        or the service manager to start the group again. Returns what requests are told."""
        if self.lost is None:
            self.lost = f"{why}; this node is stopping so that the group can be started again"
            log.error("%s", self.lost)
            for tell in self.on_lost:
                tell(self.lost)
            stop = threading.Timer(LOST_GRACE_S, os.kill, (os.getpid(), signal.SIGTERM))
            stop.daemon = True
            stop.start()
        return self.lost

    def watch(self, bells: list[Any]) -> None:
        """On a thread of its own: a rank whose doorbell socket closes is gone, and one whose
        heartbeat stops for HEARTBEAT_TIMEOUT_S is frozen; say so, and stop this node (its
        own graceful stop) for the group to be started again."""
        heard = {bell: time.monotonic() for bell in bells}
        while self.lost is None:
            readable, _, _ = select.select(bells, [], [], HEARTBEAT_S / 2)
            now = time.monotonic()
            for bell in readable:
                try:
                    beats = bell.recv(4096)
                except OSError:
                    beats = b""
                if not beats:  # (where the node stopped the group itself, `lost` says so)
                    self.lose("a rank of the decode group is gone")
                    return
                heard[bell] = now
            silent = max(now - t for t in heard.values())
            if silent > HEARTBEAT_TIMEOUT_S:
                self.lose(f"a rank of the decode group stopped answering ({silent:.0f} s silent)")
                return


def load_rank0(model_dir: str | Path, launch: GroupLaunch) -> Rank0:
    """On rank 0's mlx thread: join the group, load rank 0's stage (the last layers)."""
    group = init(launch)
    spec = load_spec(model_dir)
    stage, tokenizer, shares = load_stage(model_dir, group)
    first, end = stage.layers_range
    if all(k.kind == "linear" for k in spec.layer_kinds[first:end]):
        raise GroupError(
            f"rank 0 holds layers {first}..{end - 1}, all linear attention: it needs one "
            "that counts positions (give it more layers)"
        )
    kinds = frozenset(k.kind for k in spec.layer_kinds)
    channel = open_channel(group)
    mirror = Mirror(channel, stage, kinds, [s.layers for s in shares])
    spans = ", ".join(f"rank {s.rank} layers {s.layers[0]}..{s.layers[1] - 1}" for s in shares)
    log.info("decode group of %d (%s): %s", group.size(), launch.backend, spans)
    rank0 = Rank0(GroupModel(stage, mirror), tokenizer, shares, launch.backend)
    threading.Thread(target=rank0.watch, args=(channel.bells,), name="tandem-group-watch",
                     daemon=True).start()  # fmt: skip
    return rank0


def follow(model_dir: str | Path, launch: GroupLaunch) -> int:
    """A rank other than 0, all its life: join, load its stage, take rank 0's orders until it
    says stop. Returns the exit code."""
    group = init(launch)
    stage: Stage
    stage, _, shares = load_stage(model_dir, group)
    first, end = stage.layers_range
    log.info("decode group rank %d: layers %d..%d, %.1f MiB of weights", group.rank(), first,
             end - 1, shares[group.rank()].weight_bytes / 2**20)  # fmt: skip
    channel = open_channel(group)
    stop = threading.Event()
    threading.Thread(target=channel.heartbeat, args=(stop,), name="tandem-group-beat",
                     daemon=True).start()  # fmt: skip
    try:
        Follower(channel, stage, load_spec(model_dir)).run()
    except GroupLost as e:
        log.error("decode group rank %d: %s; exiting", group.rank(), e)
        return 1
    finally:
        stop.set()
        channel.close()
    log.info("decode group rank %d: rank 0 stopped the group", group.rank())
    return 0
