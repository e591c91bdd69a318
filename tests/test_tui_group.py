"""Issue 38: the dashboard shows a decode group as one node with its ranks on rows under it."""

from __future__ import annotations

from tandem.app.tui.app import TandemApp
from tandem.app.tui.client import Probe
from tandem.app.tui.cluster import NodeRow
from tandem.app.tui.fmt import format_binary
from tandem.app.tui.messages import NodeProbed
from tandem.app.tui.widgets.nodes import NodesTable, row_cells
from tandem.nodes.contract.cluster import Cluster, DecodeGroup, GroupRank, Health

GIB, MIB = 1 << 30, 1 << 20
GROUP_URL = "http://10.0.0.3:8470"
SINGLE_URL = "http://10.0.0.4:8470"
GROUP = DecodeGroup(2, "ring", (
    GroupRank(0, "mac1.local", (40, 80), 70 * GIB, 192_000_000_000),
    GroupRank(1, "mac2.local", (0, 40), 640 * MIB, 128_000_000_000),
))  # fmt: skip


def health(node_id: str, group: DecodeGroup | None) -> Health:
    return Health(node_id, f"mac-{node_id}", ("decode",), 4, "0", "mlx", 192_000_000_000, 0,
                  "llama-70b", "f", 80, group=group)  # fmt: skip


def test_binary_sizes() -> None:
    assert format_binary(70 * GIB) == "70.0 GiB"
    assert format_binary(640 * MIB) == "640 MiB"
    assert format_binary(631_808) == "617 KiB"
    assert format_binary(3 * MIB // 2) == "1.5 MiB"


def cells(table: NodesTable, key: str) -> list[str]:
    return [str(c) for c in table.get_row(key)]


async def test_a_group_is_one_node_with_its_ranks_under_it() -> None:
    app = TandemApp([GROUP_URL], token=None, mdns=False, live=False)
    async with app.run_test(size=(120, 40)) as pilot:
        app.post_message(NodeProbed(Probe(GROUP_URL, health("g", GROUP), Cluster(None))))
        app.post_message(NodeProbed(Probe(SINGLE_URL, health("s", None), Cluster(None))))
        await pilot.pause()
        table = app.query_one(NodesTable)
        keys = [row.key.value for row in table.ordered_rows]
        assert keys == [GROUP_URL, f"{GROUP_URL}#rank0", f"{GROUP_URL}#rank1", SINGLE_URL]
        node = cells(table, GROUP_URL)
        assert node[1:3] == ["decode", "group of 2 (ring)"] and "trusted" in node[5]
        assert cells(table, f"{GROUP_URL}#rank0")[:4] == [
            " └ rank 0 mac1.local",
            "",
            "layers 40..79",
            "weights 70.0 GiB · 192 GB",
        ]
        assert cells(table, f"{GROUP_URL}#rank1")[:4] == [
            " └ rank 1 mac2.local",
            "",
            "layers 0..39",
            "weights 640 MiB · 128 GB",
        ]
        assert cells(table, SINGLE_URL)[1:3] == ["decode", "mlx"]
        assert table.border_subtitle == "2/2 trusted"  # ranks are not nodes
        # the group restarted as one process: its rank rows go
        app.post_message(NodeProbed(Probe(GROUP_URL, health("g", None), Cluster(None))))
        await pilot.pause()
        assert [row.key.value for row in table.ordered_rows] == [GROUP_URL, SINGLE_URL]


def test_a_node_without_a_group_reads_as_before() -> None:
    row = NodeRow(SINGLE_URL, health("s", None))
    assert row.group is None and row_cells(row)[1:3] == ("decode", "mlx")
