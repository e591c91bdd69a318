"""A prefill node whose rank is gone (issue 52): a failed collective is `RankLost`, the node says
why in `/health` and answers every prefill with a 503 `rank_lost` until it stops itself (a
second later: SIGTERM to its own process, the node's graceful stop)."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest
import torch
from tandem.nodes.contract.events import EventBus
from tandem.nodes.contract.http import ApiError
from tandem.nodes.prefill.ranks import collective as collective_module
from tandem.nodes.prefill.ranks.collective import Collective, RankLost
from tandem.nodes.prefill.ranks.shard import Shard
from tandem.nodes.prefill.serving.server import PrefillService

from tests.conftest import MakeTiny


def test_a_failed_collective_loses_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(collective_module, "LOST_GRACE_S", 0.0)
    monkeypatch.setattr(collective_module, "_exit", lambda: None)  # the hard stop, later
    monkeypatch.setattr(collective_module.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    c = Collective(Shard(0, 2), torch.device("cpu"))

    def peer_gone(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4309")

    with pytest.raises(RankLost, match=r"a prefill rank is gone .*Connection closed by peer"):
        c._run(peer_gone)
    assert c.lost is not None and "this prefill node is stopping" in c.lost
    with pytest.raises(RankLost):  # nothing more goes to the ranks
        c.reduce(torch.ones(2))
    assert c.health().lost == c.lost
    for _ in range(100):
        if signals:
            break
        time.sleep(0.01)
    assert signals and signals[0][1] == signal.SIGTERM  # the node's own graceful stop


def test_a_lost_node_answers_503(monkeypatch: pytest.MonkeyPatch) -> None:
    service = PrefillService(SimpleNamespace(), "fp", EventBus())  # type: ignore[arg-type]
    collective = SimpleNamespace(
        lost="a prefill rank is gone (killed); this prefill node is stopping"
    )
    service._engine = SimpleNamespace(collective=collective, close=lambda: None)  # type: ignore[assignment]
    try:
        with pytest.raises(ApiError) as refused:  # whatever the body
            service.parse({"tokens": [1, 2, 3]})
        assert refused.value.status == 503 and refused.value.code == "rank_lost"
        assert "a prefill rank is gone" in str(refused.value)
    finally:
        collective.lost = None  # (closing leaves no group to leave)
        service._engine = None
        service.close()


def test_a_stopping_node_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 stops the others at shutdown: their leaving is no loss."""
    monkeypatch.setattr(collective_module, "_terminate", lambda: pytest.fail("stopped again"))
    c = Collective(Shard(1, 2), torch.device("cpu"))  # (rank 1: `stop` announces nothing)
    c.stop()
    c.lose("prefill rank 1 is gone (its connection closed)")
    assert c.lost is None


def test_a_ranks_device() -> None:
    from tandem.nodes.prefill.errors import PrefillError
    from tandem.nodes.prefill.ranks.collective import rank_device

    assert rank_device("cuda", 1) == "cuda:1" and rank_device("cpu", 1) == "cpu"
    with pytest.raises(PrefillError, match="CUDA devices or the CPU, not mps"):
        rank_device("mps", 0)


@pytest.mark.parametrize(
    ("role", "devices", "says"),
    [
        ("prefill", "cpu", "two devices or more, for --role prefill"),
        ("decode", "cpu,cpu", "two devices or more, for --role prefill"),
        ("prefill", "cpu,cuda:0", "list CUDA devices (cuda:0,cuda:1) or cpu,cpu"),
        ("prefill", "cuda:0,cuda:0", "each card once"),
        ("prefill", "cuda:0,cuda:63", "this machine has"),
    ],
)
def test_devices_it_cannot_start_are_refused_in_a_line(
    tiny_model: MakeTiny, capsys: pytest.CaptureFixture[str], role: str, devices: str, says: str
) -> None:
    from tandem.app.cli.main import main

    model = str(tiny_model(arch="llama", layers=2))
    assert main(["node", "--role", role, "--model", model, "--devices", devices]) != 0
    assert says in capsys.readouterr().err
