"""The simulator's "writes stall" probe verdict judges only partitions ids route to.

Seed 303473 (3eb0496 + the lost-destination cancel, `--faults ...,reshard,routers`):
scaling 2 -> 3 added p2 (primary s-3) while p0 was lost; the first move, 0 -> 2,
could not cut p0 and its cancel waits for p0 (its unfence), so p2 got no slot.  The
reader's probe of p2 then went where the map sends its row, to the lost p0, failed
ShardUnavailableError, and was blamed on p2's primary: a false "writes stall".
"""

from __future__ import annotations

import numpy as np

from zps.core.routing import ClusterMap, PartitionInfo
from zps.testing.sim.checks import writable


def _map(slot_map: list[int], parts: dict[int, PartitionInfo]) -> ClusterMap:
    return ClusterMap(7, len(slot_map), np.asarray(slot_map, dtype=np.int32), parts)


def test_a_served_partition_with_no_slot_is_not_judged() -> None:
    # Seed 303473's final map: p0 lost, p1 and p2 served, every slot on p0 or p1.
    parts = {
        0: PartitionInfo(epoch=1, primary=None, lost=True),
        1: PartitionInfo(epoch=2, primary="s-1", replicas=("s-2",)),
        2: PartitionInfo(epoch=1, primary="s-3", replicas=("s-4",)),
    }
    cmap = _map([0, 1, 0, 1, 0, 1, 0, 1], parts)
    assert writable(cmap, 2) is None  # no id routes to it: its probe went to p0
    assert writable(cmap, 0) is None  # lost: its calls may fail
    assert writable(cmap, 1) is parts[1]


def test_a_served_partition_with_a_slot_is_judged() -> None:
    parts = {
        0: PartitionInfo(epoch=1, primary="s-0"),
        1: PartitionInfo(epoch=1, primary="s-1"),
        2: PartitionInfo(epoch=1, primary="s-3"),
    }
    cmap = _map([0, 1, 2, 0, 1, 2, 0, 1], parts)
    assert [writable(cmap, p) for p in range(3)] == [parts[0], parts[1], parts[2]]
    assert writable(cmap, 3) is None  # not in the map


def test_an_emptied_partition_kept_for_a_while_is_not_judged() -> None:
    # Scaling down keeps the emptied partitions in the map for a few heartbeats.
    parts = {p: PartitionInfo(epoch=1, primary=f"s-{p}") for p in range(3)}
    cmap = _map([0, 1, 0, 1, 0, 1, 0, 1], parts)
    assert writable(cmap, 2) is None
