"""A broker without its record learns the slot map from the shards' claims
(zps/core/cluster.py rule 9, zps/core/slotclaims.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_cluster import by_node, primary, reg
from zps.core.cluster import Claim, ClusterState
from zps.core.slotclaims import SlotClaims
from zps.errors import ProtocolError
from zps.protocol.control import ShardClaim
from zps.protocol.messages import Role

N = 16
#: The map of a cluster scaled from 2 to 3 partitions: slots 0-4 on p0, 5-10 on p1,
#: 11-15 on p2 (not the round-robin map of 2 or 3 partitions).
SCALED = np.array([0] * 5 + [1] * 6 + [2] * 5, dtype=np.int32)


def bits(slot_map: np.ndarray, p: int) -> bytes:
    return np.packbits(slot_map == p).tobytes()


def claim(p: int, version: int, slot_map: np.ndarray = SCALED, lsn: int = 5) -> Claim:
    return Claim(p, 1, Role.PRIMARY, lsn, slots=bits(slot_map, p), slot_version=version)


def test_a_broker_without_its_record_takes_the_claimed_slots_and_partitions() -> None:
    cs = ClusterState(2, n_slots=N, hold_until=10.0)  # configured for 2, as before the scale
    for i, p in enumerate((2, 0, 1)):
        out = by_node(reg(cs, f"s{p}", claim=claim(p, 16), now=1.0 + i))
        assert out[f"s{p}"] == primary(f"s{p}", p, 1)  # p2 too: it exists again
    assert cs.n_partitions == 3
    np.testing.assert_array_equal(cs.slot_map, SCALED)
    np.testing.assert_array_equal(cs.map.slot_map, SCALED)
    assert cs.map.version > 16  # the shards take the maps that follow (rule 5)
    assert any("slot map is the shards'" in m for level, m in cs.notices if level == "warning")


def test_the_newest_claim_of_a_slot_wins() -> None:
    cs = ClusterState(2, n_slots=N, hold_until=10.0)
    old = np.arange(N, dtype=np.int32) % 2  # p1's copy missed the moves to p0
    reg(cs, "a", claim=claim(1, 3, old), now=1.0)
    reg(cs, "b", claim=claim(0, 9, np.zeros(N, np.int32)), now=2.0)  # p0 took every slot
    assert (cs.slot_map == 0).all()
    # p1 owns no slot and nothing past p0 is served but p1 itself: kept.
    assert cs.n_partitions == 2 and cs.primary_of(1) == "a"


def test_a_scaled_down_cluster_drops_the_partitions_nobody_serves() -> None:
    cs = ClusterState(2, n_slots=N, hold_until=10.0)
    reg(cs, "a", claim=claim(0, 30, np.zeros(N, np.int32)), now=1.0)
    assert cs.n_partitions == 1 and (cs.slot_map == 0).all()


def test_a_recorded_map_is_never_overridden_by_claims() -> None:
    cs = ClusterState(2, n_slots=N, hold_until=10.0)
    recorded = np.arange(N, dtype=np.int32) % 2
    cs.restore(4, cs.records(), slot_map=recorded)
    reg(cs, "a", claim=claim(0, 16), now=1.0)
    np.testing.assert_array_equal(cs.slot_map, recorded)


def test_claims_after_the_hold_change_no_slot() -> None:
    cs = ClusterState(2, n_slots=N, hold_until=1.0)
    before = cs.slot_map.copy()
    reg(cs, "a", claim=claim(0, 16), now=5.0)
    np.testing.assert_array_equal(cs.slot_map, before)


def test_slots_of_another_slot_count_are_refused_naming_the_shard() -> None:
    cs = ClusterState(2, n_slots=N, hold_until=10.0)
    bad = Claim(0, 1, Role.PRIMARY, 5, slots=b"\xff" * 4, slot_version=16)
    reg(cs, "a", claim=bad, now=1.0)
    assert cs.primary_of(0) == "a"  # the claim itself is taken
    errors = [m for level, m in cs.notices if level == "error"]
    assert any("shard a" in m and "another slot count" in m for m in errors)


def test_slot_claims_order_by_version_then_partition() -> None:
    sc = SlotClaims(N, 2)
    assert sc.learn(1, bits(SCALED, 1), 5) is None
    assert sc.learn(1, bits(np.zeros(N, np.int32), 1), 4) is None  # older: ignored
    assert sc.newest == 5
    got = sc.slot_map()
    assert (got[5:11] == 1).all()
    # Unclaimed slots keep the default map of the configured count.
    default = np.arange(N) % 2
    rest = np.r_[0:5, 11:16]
    np.testing.assert_array_equal(got[rest], default[rest])


def test_a_claim_carries_its_slots_on_the_wire() -> None:
    c = ShardClaim(2, 1, Role.PRIMARY, 7, slots=bits(SCALED, 2), slot_version=16)
    assert ShardClaim.parse(c.to_wire()) == c
    plain = ShardClaim(2, 1, Role.PRIMARY, 7)
    assert "slots" not in plain.to_wire() and ShardClaim.parse(plain.to_wire()) == plain
    with pytest.raises(ProtocolError, match="slots must be bytes"):
        ShardClaim.parse({**c.to_wire(), "slots": "not bytes"})


def test_a_stale_record_takes_the_newer_claimed_slots_only() -> None:
    # A pair's standby took over with a record of map version 10; a shard obeyed a newer
    # term, whose broker moved slots 5-10 to p1 at version 16.
    cs = ClusterState(2, n_slots=N, hold_until=10.0)
    recorded = np.array([0] * 11 + [1] * 5, dtype=np.int32)
    cs.restore(10, cs.records(), slot_map=recorded)
    moved = np.array([0] * 5 + [1] * 11, dtype=np.int32)
    reg(cs, "old", claim=claim(0, 9, np.zeros(N, np.int32)), now=1.0)  # older: not taken
    np.testing.assert_array_equal(cs.slot_map, recorded)
    cs.record_stale()
    np.testing.assert_array_equal(cs.slot_map, recorded)  # its claim is older than the record
    reg(cs, "new", claim=claim(1, 16, moved), now=2.0)
    np.testing.assert_array_equal(cs.slot_map, moved)
    assert cs.map.version > 16
    assert any("a stale state record" in m for level, m in cs.notices if level == "warning")


def mask_bits(slots: list[int]) -> bytes:
    m = np.zeros(N, np.bool_)
    m[slots] = True
    return np.packbits(m).tobytes()


def test_the_moves_under_way_are_completed_or_cancelled_by_what_the_claims_show() -> None:
    sc = SlotClaims(N, 2)
    slot_map = np.array([0] * 8 + [1] * 8, dtype=np.int32)
    slot_map[2] = 1  # slot 2: the destination serves it (activated), the source still fenced
    sc.note_moves(0, mask_bits([1, 2, 3, 4]), None)  # the source fences 1-4
    sc.note_moves(1, None, mask_bits([3, 4, 12]))  # the destination imports 3, 4 and 12
    sc.note_moves(0, mask_bits([5]), None)  # another copy of p0: joined
    assert sc.orphans(slot_map) == [
        (0, 1, (2,), "copied"),  # completed: released at the source
        (0, 1, (3, 4), "copying"),  # cancelled: unfenced, the import dropped
        (0, -1, (1, 5), "copying"),  # fenced, imported nowhere: unfenced
        (-1, 1, (12,), "copying"),  # imported, fenced nowhere: dropped
    ]


def test_a_record_less_broker_finishes_the_moves_after_its_hold_once_each() -> None:
    cs = ClusterState(2, n_slots=N, hold_until=10.0)
    fenced = Claim(0, 1, Role.PRIMARY, 5, slots=bits(SCALED, 0), slot_version=16,
                   fenced=mask_bits([0, 1]))  # fmt: skip
    importing = Claim(1, 1, Role.PRIMARY, 5, slots=bits(SCALED, 1), slot_version=16,
                      importing=mask_bits([0, 1]))  # fmt: skip
    reg(cs, "a", claim=fenced, now=1.0)
    reg(cs, "b", claim=importing, now=2.0)
    assert cs.take_orphaned_move(5.0) is None  # the hold: the claims still come
    assert cs.take_orphaned_move(11.0) == (0, 1, (0, 1), "copying")
    assert cs.take_orphaned_move(12.0) is None
    # A broker that restored its record knows its moves: claims change nothing.
    cs = ClusterState(2, n_slots=N, hold_until=10.0)
    cs.restore(4, cs.records())
    reg(cs, "a", claim=fenced, now=1.0)
    assert cs.take_orphaned_move(11.0) is None


def test_a_claim_carries_its_moves_on_the_wire() -> None:
    c = ShardClaim(0, 1, Role.PRIMARY, 7, slots=bits(SCALED, 0), slot_version=16,
                   fenced=mask_bits([1]), importing=mask_bits([2]))  # fmt: skip
    assert ShardClaim.parse(c.to_wire()) == c
    with pytest.raises(ProtocolError, match="claim fenced must be bytes"):
        ShardClaim.parse({**c.to_wire(), "fenced": 3})
