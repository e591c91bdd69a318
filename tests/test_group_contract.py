"""Issue 38: a decode group on the wire — `/health`'s `group`, the same on each `/v1/cluster`
peer (and the node itself), copied by the peer table from the peer's `/health`."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tandem.nodes.cluster.peers import PeerTable
from tandem.nodes.contract.cluster import Cluster, DecodeGroup, GroupRank, Health, Peer
from tandem.nodes.contract.http import ContractError

GIB = 1 << 30
GROUP = DecodeGroup(2, "ring", (
    GroupRank(0, "mac1", (40, 80), 70 * GIB, 192 * GIB),
    GroupRank(1, "mac2", (0, 40), 68 * GIB, 128 * GIB),
))  # fmt: skip


def health(group: DecodeGroup | None) -> Health:
    return Health("d", "mac1", ("decode",), 4, "0", "mlx", 192 * GIB, 0, "m", "f", 80,
                  group=group)  # fmt: skip


def wire(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def test_the_group_round_trips_in_health_and_peer() -> None:
    body = wire(health(GROUP).to_json())
    second = {"rank": 1, "host": "mac2", "layers": [0, 40], "weight_bytes": 68 * GIB,
              "mem_bytes": 128 * GIB}  # fmt: skip
    assert body["group"]["ranks"][1] == second
    assert Health.from_json(body).group == GROUP
    assert Health.from_json(wire(health(None).to_json())).group is None
    peer = Peer("http://mac1:8470", id="d", roles=("decode",), trusted=True, reason=None,
                group=GROUP)  # fmt: skip
    peer_body = wire(peer.to_json())
    assert peer_body["group"] == body["group"]
    assert Peer.from_json(peer_body) == peer
    cluster = Cluster.from_json(wire(Cluster(peer, (peer,)).to_json()))
    assert cluster.me is not None and cluster.me.group == GROUP and cluster.peers[0].group == GROUP
    older = {k: v for k, v in peer_body.items() if k != "group"}  # a node before issue 38
    assert Peer.from_json(older).group is None


def rank_body(**change: Any) -> dict[str, Any]:
    rank = {"rank": 1, "host": "mac2", "layers": [0, 40], "weight_bytes": 1, "mem_bytes": 2}
    return {k: v for k, v in {**rank, **change}.items() if v is not ...}


BAD = [  # (group, what the error names)
    ({"size": 2, "backend": "ring", "ranks": [rank_body(layers=[0, 40, 80])]}, "[first, end]"),
    ({"size": 2, "backend": "ring", "ranks": [rank_body(layers=[0, "40"])]}, "[first, end]"),
    ({"size": 2, "backend": "ring", "ranks": [rank_body(layers=40)]}, "[first, end]"),
    ({"size": 2, "backend": "ring", "ranks": [[1, "mac2"]]}, "ranks is not a list of objects"),
    ({"size": 2, "backend": "ring", "ranks": {"0": rank_body()}}, "ranks is not a list"),
    ({"size": 2, "backend": "ring", "ranks": [rank_body(host=...)]}, "rank lacks host"),
    ({"size": 2, "backend": "ring", "ranks": [rank_body(layers=...)]}, "rank lacks layers"),
    ({"size": 2, "backend": "ring", "ranks": [rank_body(weight_bytes=..., mem_bytes=...)]},
     "rank lacks weight_bytes, mem_bytes"),
    ({"size": 2, "ranks": [rank_body()]}, "group lacks backend"),
    ({"backend": "ring"}, "group lacks size, ranks"),
    ({"size": "2", "backend": "ring", "ranks": [rank_body()]}, "size is not an integer"),
    ({"size": 2, "backend": "ring", "ranks": [rank_body(weight_bytes=1.5)]},
     "weight_bytes is not an integer"),
    ([2, "ring"], "group is not a JSON object"),
]  # fmt: skip


@pytest.mark.parametrize(("group", "names"), BAD)
def test_a_malformed_group_is_a_contract_error_naming_what(group: Any, names: str) -> None:
    body = wire(health(GROUP).to_json())
    with pytest.raises(ContractError, match=r"^/health .*" + _escape(names)):
        Health.from_json({**body, "group": group})
    peer = {"address": "http://mac1:8470", "group": group}
    with pytest.raises(ContractError, match=r"^/v1/cluster peer .*" + _escape(names)):
        Peer.from_json(peer)
    # a bad peer is left out of a /v1/cluster body, as an unknown event is
    assert Cluster.from_json({"self": peer, "peers": [peer]}) == Cluster(None, ())


def _escape(text: str) -> str:
    return text.replace("[", r"\[").replace("]", r"\]")


async def test_the_peer_table_copies_the_group_from_the_peers_health() -> None:
    """Each health check takes the group as `/health` says it, and drops it when the node
    comes back as one process."""
    said: list[DecodeGroup | None] = [GROUP]

    async def on_health(request: web.Request) -> web.Response:
        return web.json_response(health(said[0]).to_json())

    app = web.Application()
    app.router.add_get("/health", on_health)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        address = str(server.make_url("")).rstrip("/")
        table = PeerTable("me", "f", token=None)
        table._session = session  # checked by hand, without the 2 s loop
        table.add(address)
        checked = await table.check(address)
        assert checked is not None and checked.group == GROUP
        assert Peer.from_json(wire(table.peers[address].to_json())).group == GROUP
        said[0] = None
        checked = await table.check(address)
        assert checked is not None and checked.group is None
