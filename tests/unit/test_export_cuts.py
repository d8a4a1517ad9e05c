"""An export's cuts against a cluster map that changes under them (live resharding):
the cuts are dropped and taken again from the new map, so each row is in one cut."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zps.client import export
from zps.client.export import export_model
from zps.client.session import NO_SUCH_PARTITION
from zps.core.routing import ClusterMap, PartitionInfo, default_slot_map
from zps.errors import BadRequestError, ProtocolError, ShardUnavailableError
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
        #: The slots each partition's cut names (a partition a move involved).
        self.owned: dict[int, bytes] = {}

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
        reply = {"st": "OK", "cut": [1, n], "tables": [], "lsn": n, "epoch": 1}
        if body["op"] == "cut" and partition in self.owned:
            reply["owned"] = self.owned[partition]
        fut.set_result(reply)
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


def slots(mask: np.ndarray) -> bytes:
    return np.packbits(mask).tobytes()


async def test_a_cut_in_the_middle_of_a_move_is_taken_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Partition 1 was cut after the map gave it slots 0-7 and before it served them
    (its cut names only 8-15): the rows of 0-7 would be in no cut; once it serves
    them, the cuts are whole."""
    c = Cluster(2)
    c.cluster_map = ClusterMap(
        2,
        16,
        np.repeat(np.int32([0, 1]), [0, 16]).astype(np.int32),
        {p: PartitionInfo(primary=f"s{p}") for p in range(2)},
    )
    c.owned = {0: slots(np.zeros(16, bool)), 1: slots(np.arange(16) >= 8)}

    def activated(partition: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        if partition == 1 and sum(op == "cut" for _, op in c.sent) > 2:
            c.owned[1] = slots(np.ones(16, bool))

    c.on_cut = activated
    with caplog.at_level(logging.WARNING, logger="zps.export"):
        manifest = await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    assert "partition 1 was cut in the middle of a slot move" in caplog.text
    assert [p for p, op in c.sent if op == "cut"] == [0, 1, 0, 1]
    assert sorted(manifest["partitions"]) == ["0", "1"]


async def test_a_source_cut_still_holding_slots_given_away_is_taken_again(
    tmp_path: Path,
) -> None:
    c = Cluster(2)  # the default map: slots 0-7 on partition 0, 8-15 on 1
    given = c.cluster_map.slot_map == 1
    c.owned = {0: slots(np.ones(16, bool)), 1: slots(given)}  # 0 not yet released
    released: list[int] = []

    def release(partition: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        if partition == 0 and released:
            c.owned[0] = slots(~given)
        released.append(partition)

    c.on_cut = release
    await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    assert [p for p, op in c.sent if op == "cut"] == [0, 1, 0, 1]


async def test_a_cut_naming_malformed_slots_is_a_protocol_error(tmp_path: Path) -> None:
    c = Cluster(2)
    c.owned = {1: b"\x00"}  # 16 slots need two bytes
    with pytest.raises(ProtocolError, match="partition 1's cut names its slots malformed"):
        await export_model(c, tmp_path / "out")  # type: ignore[arg-type]


async def test_cuts_wait_for_a_moment_between_moves_within_the_timeout(tmp_path: Path) -> None:
    """Moves that never stop: the export starts again more often than ``attempts`` (a
    move is not a failure), and gives up at the client's timeout, saying why."""
    c = Cluster(2)
    c.config = ClientConfig(timeout=0.5)
    version = [0]

    def always_moving(partition: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        if partition == 1:
            version[0] += 1
            n = 2 + version[0] % 2  # 2, 3, 2, ...: a partition added, removed, ...
            c.cluster_map = cmap(version[0], n)

    c.on_cut = always_moving
    with pytest.raises(BadRequestError, match=r"kept moving slots for 0\.5s"):
        await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    assert sum(op == "cut" and p == 0 for p, op in c.sent) > 3


async def test_the_cuts_taken_are_freed_when_another_fails(tmp_path: Path) -> None:
    c = Cluster(3)

    def scale_down(partition: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        if partition == 1:
            c.cluster_map, c.on_cut = cmap(2, 2), None
            fut.set_exception(
                ShardUnavailableError("gone", partition=1, missing=NO_SUCH_PARTITION, waited=0)
            )

    c.on_cut = scale_down
    await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    first = c.sent[: c.sent.index((0, "cut"), 1)]  # the first attempt, up to its next cut
    assert sorted(p for p, op in first if op == "cut_drop") == [0, 2]


async def test_a_whole_cut_starts_the_wait_for_moves_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for a moment between moves counts from the last attempt whose cuts were
    whole: a partition removed while a long read goes on is not 'kept moving'."""
    c = Cluster(2)
    c.config = ClientConfig(timeout=0.3)
    calls = [0]
    real = export._export_once

    async def once(*args: Any) -> dict[str, Any]:
        calls[0] += 1
        if calls[0] == 1:
            raise export._Resharded("moved")
        if calls[0] == 2:
            args[-1]()  # its cuts were whole
            await asyncio.sleep(0.5)  # a long read, past the timeout
            raise ShardUnavailableError("gone", partition=1, missing=NO_SUCH_PARTITION, waited=0)
        return await real(*args)

    monkeypatch.setattr(export, "_export_once", once)
    manifest = await export_model(c, tmp_path / "out")  # type: ignore[arg-type]
    assert calls[0] == 3 and sorted(manifest["partitions"]) == ["0", "1"]
