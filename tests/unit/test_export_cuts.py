"""An export's cuts against a cluster map that changes under them (live resharding):
the cuts are dropped and taken again from the new map, so each row is in one cut."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from zps.client.export import export_model
from zps.client.session import NO_SUCH_PARTITION
from zps.core.routing import ClusterMap, PartitionInfo, default_slot_map
from zps.errors import ShardUnavailableError
from zps.model.format import Export
from zps.ops.config import ClientConfig


def cmap(version: int, n: int) -> ClusterMap:
    parts = {p: PartitionInfo(primary=f"s{p}") for p in range(n)}
    return ClusterMap(version, 16, default_slot_map(16, n), parts)


class Cluster:
    """The client's side of an export of a cluster holding no table: each ``cut`` is
    answered; ``on_cut`` may change the map the client holds as a cut is sent."""

    def __init__(self, n: int) -> None:
        self.config = ClientConfig()
        self.cluster_map = cmap(1, n)
        self.sent: list[tuple[int, str]] = []
        self.on_cut: Any = None

    def submit(
        self, partition: int, body: dict[str, Any], arrays: Any, *, reply_bytes: int = 0
    ) -> asyncio.Future[dict[str, Any]]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.sent.append((partition, body["op"]))
        if body["op"] == "cut" and self.on_cut is not None:
            self.on_cut(partition, fut)
            if fut.done():
                return fut
        n = len(self.sent)
        fut.set_result({"st": "OK", "cut": [1, n], "tables": [], "lsn": n, "epoch": 1})
        return fut


async def test_a_slot_map_changed_during_the_cuts_takes_them_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = Cluster(2)

    def scale_up(partition: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        c.cluster_map, c.on_cut = cmap(2, 4), None  # a move published while cutting

    c.on_cut = scale_up
    with caplog.at_level(logging.WARNING, logger="zps.export"):
        manifest = await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    assert "moved slots while the partitions were cut" in caplog.text
    assert c.sent[:4] == [(0, "cut"), (1, "cut"), (0, "cut_drop"), (1, "cut_drop")]
    assert sorted(p for p, op in c.sent[4:] if op == "cut") == [0, 1, 2, 3]
    assert sorted(manifest["partitions"]) == ["0", "1", "2", "3"]
    assert sorted(Export(tmp_path / "out").manifest["partitions"]) == ["0", "1", "2", "3"]


async def test_a_partition_removed_during_the_cuts_takes_them_again(tmp_path: Path) -> None:
    c = Cluster(2)

    def scale_down(partition: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        if partition == 1:  # the client's session fails a request for a partition gone
            c.cluster_map, c.on_cut = cmap(2, 1), None
            fut.set_exception(
                ShardUnavailableError("gone", partition=1, missing=NO_SUCH_PARTITION, waited=0)
            )

    c.on_cut = scale_down
    manifest = await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    assert sorted(manifest["partitions"]) == ["0"]
    assert [p for p, op in c.sent if op == "cut"] == [0, 1, 0]


async def test_an_unavailable_partition_is_not_taken_for_a_move(tmp_path: Path) -> None:
    c = Cluster(2)

    def lost(partition: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        if partition == 1:
            fut.set_exception(ShardUnavailableError("lost", partition=1, missing="lost"))

    c.on_cut = lost
    with pytest.raises(ShardUnavailableError, match="lost"):
        await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    assert [p for p, op in c.sent if op == "cut"] == [0, 1]  # not taken again
