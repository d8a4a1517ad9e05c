"""A shard's role, replication and lease state, driven without sockets or sleeps."""

from __future__ import annotations

import pytest

from zps.protocol.messages import Role
from zps.shard.session import AckResult, ShardSession

P, E = 3, 4
HB, LIVENESS = 0.25, 4  # lease: 0.75 s; a silent peer is dead after 1 s
LEASE = HB * (LIVENESS - 1)
ME = "s-me"


def session(
    *, interval_s: float = 0.0, every: int = 0, checkpoints: bool = False
) -> ShardSession[str]:
    return ShardSession(
        ME,
        heartbeat_interval=HB,
        liveness=LIVENESS,
        checkpoint_interval_s=interval_s,
        checkpoint_every_updates=every,
        checkpoints=checkpoints,
        now=0.0,
    )


def primary(*replicas: str, now: float = 0.0) -> ShardSession[str]:
    """A primary of P at E that holds a lease from a heartbeat sent at ``now``."""
    s = session()
    assert s.assign(Role.PRIMARY, P, E).changed
    s.on_map(E, set(), set(replicas))
    s.echoed(now, "primary", P, E)
    return s


def ack(s: ShardSession[str], node: str, lsn: int, epoch: int, now: float) -> AckResult[str]:
    """``node`` acknowledges ``lsn``, naming the snapshot it was sent."""
    follower = s.followers.get(node)
    return s.acked(node, lsn, epoch, now, follower.snapshot_lsn if follower else 0)


def in_sync(s: ShardSession[str], node: str, *, lsn: int = 0, now: float = 0.0) -> None:
    """``node`` subscribes at ``lsn`` and acknowledges it."""
    assert s.accepts_subscription(node, P, E)
    s.subscribed(node, lsn, now)
    assert ack(s, node, lsn, E, now).in_sync


# ---- lease ------------------------------------------------------------------


def test_a_spare_has_no_lease_and_needs_none() -> None:
    s = session()
    assert s.may_write(100.0)  # the core refuses a spare's requests, not the lease


def test_a_new_primary_has_no_lease_until_a_heartbeat_is_echoed() -> None:
    s = session()
    s.assign(Role.PRIMARY, P, E)
    assert not s.may_write(0.1)
    s.echoed(0.1, "primary", P, E)
    assert s.may_write(0.2)


def test_the_lease_lapses_when_heartbeats_stop_being_echoed_and_returns_on_echo() -> None:
    s = primary(now=1.0)
    assert s.may_write(1.0 + LEASE - 0.01)
    assert not s.may_write(1.0 + LEASE)  # nothing echoed since: writes are refused
    assert not s.may_write(5.0)
    s.echoed(4.9, "primary", P, E)  # the broker answers a heartbeat sent at 4.9
    assert s.may_write(5.0)
    s.echoed(2.0, "primary", P, E)  # a late echo of an older heartbeat does not shorten it
    assert s.may_write(4.9 + LEASE - 0.01)


@pytest.mark.parametrize(
    "echo",
    [
        (1.0, "replica", P, E),  # another role
        (1.0, "primary", P + 1, E),  # another partition
        (1.0, "primary", P, E - 1),  # another epoch
        (1, "primary", P, E),  # not a send time
        (None, "primary", P, E),
    ],
)
def test_an_echo_for_another_assignment_grants_no_lease(echo: tuple[object, ...]) -> None:
    s = session()
    s.assign(Role.PRIMARY, P, E)
    s.echoed(*echo)
    assert not s.may_write(1.1)


def test_stepping_down_forfeits_the_lease() -> None:
    s = primary(now=1.0)
    s.assign(Role.REPLICA, P, E + 1, "tcp://p2:1")
    s.assign(Role.PRIMARY, P, E + 2)  # promoted again: only a new echo gives a lease
    assert not s.may_write(1.1)
    s.echoed(1.05, "primary", P, E + 2)
    assert s.may_write(1.1)


def test_the_broker_is_reported_lost_once_and_regained_on_traffic() -> None:
    s = primary()
    assert s.tick(0.5, requests=0, lsn=0).broker_lost_for is None
    assert s.tick(HB * LIVENESS, requests=0, lsn=0).broker_lost_for is None  # not yet past
    lost = s.tick(1.25, requests=0, lsn=0).broker_lost_for
    assert lost == pytest.approx(1.25)
    assert s.broker_lost
    assert s.tick(1.5, requests=0, lsn=0).broker_lost_for is None  # said once
    assert s.broker_seen(1.6)  # regained: the driver logs it
    assert not s.broker_seen(1.7)
    assert s.tick(2.0, requests=0, lsn=0).broker_lost_for is None
    assert s.tick(2.8, requests=0, lsn=0).broker_lost_for == pytest.approx(1.1)


def test_heartbeats_carry_the_send_time_and_a_primarys_in_sync_set() -> None:
    s = primary("r1", "r2")
    in_sync(s, "r2")
    assert s.heartbeat_fields(3.0) == {"t": 3.0, "epoch": E, "in_sync": ["r2"]}
    s.assign(Role.REPLICA, P, E + 1, "tcp://p2:1")
    assert s.heartbeat_fields(4.0) == {"t": 4.0, "epoch": E + 1}


# ---- in-sync set (primary side) -----------------------------------------------


def test_only_the_partitions_replicas_at_this_epoch_may_subscribe() -> None:
    s = primary("r1")
    assert s.accepts_subscription("r1", P, E)
    assert not s.accepts_subscription("stranger", P, E)
    assert not s.accepts_subscription("r1", P + 1, E)
    assert not s.accepts_subscription("r1", P, E - 1)
    s.assign(Role.SPARE, None, 0)
    assert not s.accepts_subscription("r1", P, E)


def test_a_replica_is_in_sync_only_once_it_acked_its_snapshots_lsn() -> None:
    s = primary("r1")
    s.subscribed("r1", 10, now=0.0)
    assert s.heartbeat_fields(0.0)["in_sync"] == []
    got = ack(s, "r1", 9, E, 0.1)
    assert not got.in_sync and "r1" not in s.local_in_sync
    assert ack(s, "r1", 10, E, 0.2).in_sync
    assert s.heartbeat_fields(0.3)["in_sync"] == ["r1"]
    assert not ack(s, "r1", 11, E, 0.3).in_sync  # reported once


def test_acks_from_another_epoch_or_a_stranger_count_for_nothing() -> None:
    s = primary("r1")
    s.subscribed("r1", 5, now=0.0)
    assert not ack(s, "r1", 5, E - 1, 0.1).in_sync
    assert not ack(s, "r2", 5, E, 0.1).in_sync
    assert s.followers["r1"].acked == 0
    assert s.local_in_sync == set()


def test_a_resubscribing_replica_leaves_the_in_sync_set_until_it_acks_again() -> None:
    s = primary("r1")
    in_sync(s, "r1", lsn=3)
    s.subscribed("r1", 8, now=1.0)
    assert s.local_in_sync == set()
    assert ack(s, "r1", 8, E, 1.1).in_sync


def test_writes_wait_for_an_in_sync_replica_and_are_released_by_its_ack() -> None:
    s = primary("r1")
    assert s.add_write(1, "w1") == ["w1"]  # no replica required yet
    in_sync(s, "r1", lsn=1)
    assert s.add_write(2, "w2") == []
    assert s.add_write(3, "w3") == []
    assert ack(s, "r1", 2, E, 0.1).released == ["w2"]
    assert ack(s, "r1", 3, E, 0.2).released == ["w3"]


def test_a_follower_that_goes_away_leaves_the_in_sync_set() -> None:
    s = primary("r1", "r2")
    in_sync(s, "r1")
    in_sync(s, "r2")
    assert s.follower_gone("r1")
    assert not s.follower_gone("r1")  # once
    assert s.heartbeat_fields(1.0)["in_sync"] == ["r2"]
    assert set(s.followers) == {"r2"}


def test_a_silent_replica_holding_writes_back_is_reported_out_of_sync() -> None:
    s = primary("r1", "r2")
    in_sync(s, "r1", now=0.0)
    in_sync(s, "r2", now=0.0)
    s.on_map(E, {"r1", "r2"}, {"r1", "r2"})
    assert s.tick(0.5, requests=0, lsn=0).lagging == ()
    assert s.add_write(1, "w1") == []
    assert ack(s, "r2", 1, E, 0.9).released == []  # r1 stays silent
    assert s.tick(1.0, requests=1, lsn=1).lagging == ()  # silent for the timeout, not past it
    assert s.tick(1.01, requests=1, lsn=1).lagging == ("r1",)
    assert s.heartbeat_fields(1.01)["in_sync"] == ["r2"]
    assert s.tick(1.5, requests=1, lsn=1).lagging == ()  # reported once
    # The write is held until the broker publishes the smaller set.
    assert s.on_map(E, {"r2"}, {"r1", "r2"}).released == ["w1"]


def test_a_silent_replica_is_not_reported_while_no_write_waits() -> None:
    s = primary("r1")
    in_sync(s, "r1", now=0.0)
    assert s.tick(5.0, requests=0, lsn=0).lagging == ()
    assert s.local_in_sync == {"r1"}


def test_the_broker_only_shrinks_the_set_it_published() -> None:
    s = primary("r1", "r2")
    in_sync(s, "r1")
    s.on_map(E, {"r1"}, {"r1", "r2"})
    in_sync(s, "r2")  # caught up since; not yet in the broker's map
    assert s.add_write(1, "w1") == []
    assert s.on_map(E, set(), {"r1", "r2"}).released == []  # r1 dropped; r2 still required
    assert s.local_in_sync == {"r2"}
    assert s.on_map(E - 1, set(), set()).released == []  # an old map changes nothing
    assert ack(s, "r2", 1, E, 0.2).released == ["w1"]


def test_a_replica_learns_from_the_map_whether_it_is_in_sync() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.on_map(E, {ME}, {ME})
    claim = s.claim(7)  # the map says so, but no snapshot of this primary is loaded
    assert claim is not None and claim["in_sync"] is False
    s.snapshot_loaded(True, 7)
    assert s.claim(7) == {"partition": P, "epoch": E, "role": "replica", "lsn": 7, "in_sync": True}
    s.on_map(E, set(), {ME})
    claim = s.claim(7)
    assert claim is not None and claim["in_sync"] is False


# ---- promotion and demotion ---------------------------------------------------


def test_demotion_refuses_the_waiting_writes_and_forgets_the_followers() -> None:
    s = primary("r1")
    in_sync(s, "r1")
    s.add_write(1, "w1")
    s.add_write(2, "w2")
    change = s.assign(Role.REPLICA, P, E + 1, "tcp://p2:1")
    assert change.changed and change.refused == ["w1", "w2"]
    assert change.was == (Role.PRIMARY, P, E)
    assert change.follow == "tcp://p2:1" and s.following == ("tcp://p2:1", E + 1)
    assert s.followers == {} and s.local_in_sync == set() and len(s.tracker) == 0
    assert s.role is Role.REPLICA and s.epoch == E + 1


def test_a_promoted_replica_writes_only_after_an_echo_of_its_new_role() -> None:
    # Its echoes as a replica renewed a lease of that role: promoted, it may write only
    # once the broker echoes the primary's role at the new epoch (which waits until the
    # broker's record names that epoch); a write acknowledged before would be lost if a
    # restarted broker elected the old primary.
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.echoed(10.0, "replica", P, E)
    s.assign(Role.PRIMARY, P, E + 1)
    assert not s.may_write(10.01)
    s.echoed(10.02, "primary", P, E)  # an echo of the old epoch renews nothing
    assert not s.may_write(10.03)
    s.echoed(10.02, "primary", P, E + 1)
    assert s.may_write(10.03)


def test_promotion_stops_following_and_starts_with_no_followers() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.snapshot_loaded(True, 0)
    change = s.assign(Role.PRIMARY, P, E + 1)
    assert change.changed and change.stop_following and change.refused == []
    assert s.following is None and not s.synced
    assert s.role is Role.PRIMARY and (s.partition, s.epoch) == (P, E + 1)
    assert s.followers == {}


def test_a_repeated_assignment_changes_nothing() -> None:
    s = primary("r1")
    in_sync(s, "r1")
    s.add_write(1, "w1")
    assert not s.assign(Role.PRIMARY, P, E).changed
    assert s.local_in_sync == {"r1"} and len(s.tracker) == 1 and s.may_write(0.1)
    r = session()
    r.assign(Role.REPLICA, P, E, "tcp://p:1")
    r.snapshot_loaded(True, 0)
    assert not r.assign(Role.REPLICA, P, E, "tcp://p:1").changed
    assert r.synced
    moved = r.assign(Role.REPLICA, P, E, "tcp://p:2")  # same epoch, another primary address
    assert moved.changed and moved.follow == "tcp://p:2" and moved.stop_following
    assert not r.synced


def test_becoming_a_spare_drops_the_partition() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    change = s.assign(Role.SPARE, None, 0)
    assert change.stop_following and s.following is None
    assert (s.role, s.partition, s.epoch) == (Role.SPARE, None, 0)
    assert s.claim(0) is None


def test_a_restored_shard_claims_its_partition_as_primary_until_assigned() -> None:
    s = session()
    assert s.claim(0) is None
    s.restore(P, E, 42, now=0.0)
    assert s.claim(42) == {
        "partition": P,
        "epoch": E,
        "role": "primary",
        "lsn": 42,
        "in_sync": False,
    }
    s.assign(Role.PRIMARY, P, E)
    assert s.claim(43) == {
        "partition": P,
        "epoch": E,
        "role": "primary",
        "lsn": 43,
        "in_sync": False,
    }


# ---- replica side ---------------------------------------------------------------


def test_a_replica_asks_for_the_stream_until_its_snapshot_loads() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.upstream_started()
    assert s.subscribe_due(10.0)
    s.subscribe_sent(10.0)
    assert not s.subscribe_due(10.0 + 2 * HB)
    assert s.subscribe_due(10.0 + 2 * HB + 0.01)  # the primary may not have known its role
    s.snapshot_loaded(False, 0)  # another partition's or epoch's: still not synced
    assert not s.synced and s.subscribe_due(11.0)
    s.snapshot_loaded(True, 0)
    assert s.synced and not s.subscribe_due(20.0)


def test_bye_from_the_primary_resets_sync_and_asks_again_when_due() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.upstream_started()
    s.subscribe_sent(10.0)
    s.snapshot_loaded(True, 0)
    s.refused()
    assert not s.synced and not s.whole
    assert not s.subscribe_due(10.1)
    assert s.subscribe_due(10.6)


def test_a_broken_stream_resubscribes_at_once() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.upstream_started()
    s.subscribe_sent(10.0)
    s.snapshot_loaded(True, 0)
    s.resync()
    assert not s.synced and s.subscribe_due(10.01)


def test_a_replica_acks_upstream_on_ticks_only_once_its_snapshot_is_loaded() -> None:
    s = session()
    assert not s.tick(0.25, requests=0, lsn=0).ack_upstream  # a spare follows nobody
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    assert not s.tick(0.3, requests=0, lsn=0).ack_upstream  # its state is another history
    s.snapshot_loaded(True, 4)
    assert s.base_lsn == 4
    assert s.tick(0.5, requests=0, lsn=0).ack_upstream
    s.assign(Role.REPLICA, P, E, "")  # no primary known: keeps its subscription
    assert s.tick(0.75, requests=0, lsn=0).ack_upstream


# ---- leaving ---------------------------------------------------------------------


def test_leaving_refuses_waiting_writes_and_becomes_a_spare() -> None:
    s = primary("r1")
    in_sync(s, "r1")
    s.add_write(1, "w1")
    assert s.begin_leave()  # a primary's state is whole: write a final checkpoint
    assert s.leaving
    assert s.left() == ["w1"]
    assert s.role is Role.SPARE and s.followers == {}


def test_a_replica_that_never_synced_leaves_without_a_whole_state() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    assert not s.begin_leave()
    assert s.left() == [] and s.following is None


# ---- checkpoints and trims --------------------------------------------------------


def test_a_checkpoint_is_due_after_the_interval_and_not_before() -> None:
    s = session(interval_s=30.0, checkpoints=True)
    s.assign(Role.PRIMARY, P, E)
    s.broker_seen(29.0)
    assert not s.checkpoint_due(29.9, lsn=5)
    assert not s.tick(29.9, requests=0, lsn=5).checkpoint
    assert s.checkpoint_due(30.0, lsn=5)
    s.broker_seen(30.0)
    assert s.tick(30.0, requests=0, lsn=5).checkpoint
    assert s.begin_checkpoint(30.0, 5)
    assert not s.checkpoint_due(59.9, lsn=6)
    assert s.checkpoint_due(60.0, lsn=6)


def test_a_checkpoint_is_due_after_enough_updates() -> None:
    s = session(every=100)
    s.assign(Role.PRIMARY, P, E)
    assert not s.checkpoint_due(1e6, lsn=99)
    assert s.checkpoint_due(0.0, lsn=100)
    assert s.begin_checkpoint(1.0, 100)
    assert not s.checkpoint_due(2.0, lsn=199)
    assert s.checkpoint_due(2.0, lsn=200)


def test_without_a_data_dir_no_checkpoint_is_ever_due_on_a_tick() -> None:
    s = session(interval_s=1.0, checkpoints=False)
    s.assign(Role.PRIMARY, P, E)
    assert s.checkpoint_due(5.0, lsn=5)
    assert not s.tick(5.0, requests=0, lsn=5).checkpoint


def test_only_a_whole_new_state_is_checkpointed() -> None:
    s = session(interval_s=1.0)
    assert not s.begin_checkpoint(1.0, 5)  # no partition
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    assert not s.begin_checkpoint(1.0, 5)  # not synced: not whole
    s.snapshot_loaded(True, 0)
    assert not s.begin_checkpoint(1.0, 0)  # nothing to keep
    assert s.begin_checkpoint(1.0, 5)
    assert s.last_checkpoint == (1.0, 5)
    assert not s.begin_checkpoint(2.0, 5)  # unchanged since
    s.refused()
    assert not s.begin_checkpoint(3.0, 6)  # no longer whole
    assert s.begin_checkpoint(3.0, 6, final=True)  # the final one is written regardless


def test_a_restored_state_is_written_again_on_leaving() -> None:
    s = session()
    s.restore(P, E, 9, now=0.0)
    assert not s.begin_checkpoint(1.0, 9)  # unchanged since it was written
    assert s.begin_checkpoint(1.0, 9, final=True)  # a final one is written again
    t = session()
    t.assign(Role.PRIMARY, P, E)
    assert t.begin_checkpoint(1.0, 9)
    assert not t.begin_checkpoint(2.0, 9, final=True)  # not restored: nothing new


def test_a_snapshot_kept_as_a_checkpoint_makes_the_next_one_due_from_it() -> None:
    # A replica that joined by snapshot has just written the whole partition as its
    # checkpoint: the interval and the update count start from it, not from the start.
    timed = session(interval_s=30.0, checkpoints=True)
    counted = session(every=100)
    for s in (timed, counted):
        s.assign(Role.REPLICA, P, E, "tcp://p:1")
        assert s.checkpoint_due(40.0, lsn=500)  # nothing written since the process began
        s.snapshot_loaded(True, 500)
        s.checkpoint_kept(40.0, 500)
        assert not s.checkpoint_due(40.1, lsn=500)
    assert not timed.checkpoint_due(69.9, lsn=599) and timed.checkpoint_due(70.0, lsn=500)
    assert not counted.checkpoint_due(41.0, lsn=599) and counted.checkpoint_due(41.0, lsn=600)


def test_a_checkpoint_due_takes_the_tick_instead_of_the_upstream_ack() -> None:
    s = session(interval_s=1.0, checkpoints=True)
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    tick = s.tick(1.0, requests=0, lsn=3)
    assert tick.checkpoint and not tick.ack_upstream


def test_memory_is_trimmed_after_a_quiet_interval_following_traffic() -> None:
    s = session()
    assert not s.tick(0.25, requests=0, lsn=0).trim  # no traffic yet
    assert not s.tick(0.5, requests=10, lsn=0).trim  # busy
    assert not s.tick(0.75, requests=20, lsn=0).trim  # still busy
    assert s.tick(1.0, requests=20, lsn=0).trim  # quiet: trim once
    assert not s.tick(1.25, requests=20, lsn=0).trim


def test_a_new_upstream_subscription_asks_at_once() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.upstream_started()
    s.subscribe_sent(10.0)
    s.snapshot_loaded(True, 0)
    s.assign(Role.REPLICA, P, E + 1, "tcp://p:2")  # a new primary: a new subscription
    s.upstream_started()
    assert not s.synced and s.subscribe_due(10.01)


def test_a_spare_holds_no_partition_whatever_the_assignment_says() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.assign(Role.SPARE, P, E)
    assert (s.partition, s.epoch) == (None, 0)


# ---- gray replicas: dropped on silence, in sync only from its own snapshot ------


def test_a_silent_replica_behind_the_primary_is_dropped_even_with_no_write_waiting() -> None:
    s = primary("r1", "r2")
    in_sync(s, "r1", now=0.0)
    in_sync(s, "r2", now=0.0)
    # acks=1 writes: nothing waits, but r1 stops acknowledging the stream.
    assert ack(s, "r2", 5, E, 0.9).released == []
    assert s.tick(1.0, requests=5, lsn=5).lagging == ()  # the timeout, not past it
    assert s.tick(1.01, requests=5, lsn=5).lagging == ("r1",)
    assert s.local_in_sync == {"r2"}
    assert s.follower_gone("r1")  # the driver drops it: it must resynchronise
    assert s.heartbeat_fields(1.02)["in_sync"] == ["r2"]
    # r2 acknowledged everything: silence alone is no reason to drop it.
    assert s.tick(5.0, requests=5, lsn=5).lagging == ()


def test_a_dropped_replica_comes_back_only_through_a_new_snapshot() -> None:
    s = primary("r1")
    in_sync(s, "r1", lsn=2)
    assert s.follower_gone("r1")
    assert s.acked("r1", 9, E, 1.0, 2).in_sync is False  # no longer a follower
    assert "r1" not in s.local_in_sync
    s.subscribed("r1", 9, 1.1)
    assert ack(s, "r1", 9, E, 1.2).in_sync


def test_an_acknowledgement_from_another_history_counts_for_nothing() -> None:
    # A shard that held the partition at an older epoch kept LSN 100; it subscribes and
    # is sent a snapshot at 40.  Before it loaded that, its acks name another base.
    s = primary("r1")
    s.subscribed("r1", 40, now=0.0)
    got = s.acked("r1", 100, E, 0.1, -1)  # nothing loaded yet
    assert not got.in_sync and s.followers["r1"].acked == 0
    assert not s.acked("r1", 100, E, 0.1, 39).in_sync  # an earlier snapshot's stream
    assert not s.acked("r1", 100, E, 0.1, None).in_sync  # an ack without a base
    assert s.add_write(41, "w41") == ["w41"]  # r1 holds nothing back: it is not in sync
    # Loaded, but w41 was acknowledged without it: in sync once it holds w41 too.
    assert not s.acked("r1", 40, E, 0.2, 40).in_sync
    assert s.add_write(42, "w42") == []  # from now on it holds writes back
    got = s.acked("r1", 41, E, 0.3, 40)
    assert got.in_sync and got.released == []
    assert s.acked("r1", 42, E, 0.4, 40).released == ["w42"]


def test_a_replica_names_the_snapshot_it_loaded_and_forgets_it_on_resync() -> None:
    s = session()
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    assert s.base_lsn == -1
    s.snapshot_loaded(True, 12)
    assert (s.synced, s.base_lsn) == (True, 12)
    s.snapshot_loaded(False, 30)  # another epoch's: not loaded
    assert (s.synced, s.base_lsn) == (False, -1)
    s.snapshot_loaded(True, 30)
    s.assign(Role.REPLICA, P, E + 1, "tcp://p:2")  # a new primary: a new history
    assert (s.synced, s.base_lsn) == (False, -1)


# ---- min_in_sync ------------------------------------------------------------------


def strict(*replicas: str, min_in_sync: int = 2) -> ShardSession[str]:
    s: ShardSession[str] = ShardSession(
        ME, heartbeat_interval=HB, liveness=LIVENESS, min_in_sync=min_in_sync, now=0
    )
    s.assign(Role.PRIMARY, P, E)
    s.on_map(E, set(), set(replicas))
    s.echoed(0.0, "primary", P, E)
    return s


def test_min_in_sync_refuses_acks_all_writes_until_a_replica_is_in_sync() -> None:
    s = strict("r1")
    assert s.needed_copies == 2
    assert not s.enough_in_sync()  # r1 is listed, but has not caught up
    in_sync(s, "r1", lsn=0)
    assert s.enough_in_sync()


def test_min_in_sync_is_capped_at_the_copies_a_partition_is_given() -> None:
    s = strict()  # replication 1: no replica was ever listed
    assert s.needed_copies == 1 and s.enough_in_sync()
    t = strict("r1", "r2", min_in_sync=5)
    assert t.needed_copies == 3


def test_min_in_sync_counts_the_copies_seen_before_a_promotion() -> None:
    # Replication 2: this shard was the replica; its primary died and no spare is left.
    s: ShardSession[str] = ShardSession(
        ME, heartbeat_interval=HB, liveness=LIVENESS, min_in_sync=2, now=0
    )
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.on_map(E, {ME}, {ME})
    s.assign(Role.PRIMARY, P, E + 1)
    s.on_map(E + 1, set(), set())
    assert not s.enough_in_sync()  # acks="all" must not quietly become acks=1
    s.assign(Role.SPARE, None, 0)
    s.assign(Role.PRIMARY, P + 1, E)  # another partition: learnt afresh
    assert s.enough_in_sync()


def test_writes_waiting_when_the_set_falls_below_min_in_sync_are_refused() -> None:
    s = strict("r1", "r2")
    in_sync(s, "r1")
    in_sync(s, "r2")
    s.on_map(E, {"r1", "r2"}, {"r1", "r2"})
    assert s.add_write(1, "w1") == [] and s.add_write(2, "w2") == []
    assert ack(s, "r1", 1, E, 0.1).released == []
    done = s.on_map(E, {"r1"}, {"r1", "r2"})  # r2 dropped; r1 still in sync: enough
    assert done.released == ["w1"] and done.refused == []
    assert s.follower_gone("r1")
    done = s.on_map(E, set(), {"r1", "r2"})  # no replica in sync: w2 has too few copies
    assert done.released == [] and done.refused == ["w2"]
    assert not s.enough_in_sync() and len(s.tracker) == 0


def test_min_in_sync_never_refuses_for_a_shard_that_is_not_primary() -> None:
    s: ShardSession[str] = ShardSession(
        ME, heartbeat_interval=HB, liveness=LIVENESS, min_in_sync=2, now=0
    )
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.on_map(E, set(), {ME})
    assert s.enough_in_sync()  # the core answers NOT_PRIMARY instead


def test_min_in_sync_must_be_positive() -> None:
    with pytest.raises(ValueError, match="min_in_sync"):
        ShardSession(ME, heartbeat_interval=HB, liveness=LIVENESS, min_in_sync=0, now=0)


# ---- writes never wait for a replica that left both in-sync sets -----------------


def test_a_replica_the_broker_gave_away_does_not_come_back_in_sync_by_acking() -> None:
    s = primary("r1", "r2")
    in_sync(s, "r1", lsn=1)
    in_sync(s, "r2", lsn=1)
    s.on_map(E, {"r1", "r2"}, {"r1", "r2"})
    # r1 was paused past the liveness timeout: the broker declared it dead and put a
    # spare in its place; the map no longer lists it.
    s.on_map(E, {"r2"}, {"r2", "r3"})
    assert "r1" not in s.local_in_sync
    # Resumed, it acknowledges the stream it still follows: that counts for nothing.
    result = ack(s, "r1", 5, E, 2.0)
    assert not result.in_sync and "r1" not in s.local_in_sync
    assert s.tracker.required == {"r2"}


def test_writes_never_wait_for_a_follower_dropped_after_the_broker_removed_it() -> None:
    s = primary("r1", "r2")
    in_sync(s, "r2", lsn=0)
    s.on_map(E, {"r2"}, {"r1", "r2"})  # published: r2
    in_sync(s, "r1", lsn=0)  # r1 caught up since: required locally
    assert s.tracker.required == {"r1", "r2"}
    assert s.add_write(1, "w1") == []
    assert ack(s, "r2", 1, E, 0.5).released == []  # still waits for r1
    # r1's connection goes; the broker never listed it in sync, so no map will.
    assert s.follower_gone("r1")
    done = s.settle()
    assert done.released == ["w1"] and done.refused == []
    assert s.tracker.required == {"r2"}


def test_dropping_a_follower_below_min_in_sync_refuses_what_waits() -> None:
    s = primary("r1")
    s.min_in_sync = 2
    in_sync(s, "r1", lsn=0)  # required locally only: the broker has not published it
    assert s.add_write(1, "w1") == []
    assert s.follower_gone("r1")
    done = s.settle()
    assert done.released == [] and done.refused == ["w1"]
    assert not s.enough_in_sync()


def test_a_repairing_partition_takes_writes_on_the_copies_in_sync() -> None:
    """Replication 2, min_in_sync 2: this replica was promoted and a spare replaces the
    lost copy.  While the spare loads its snapshot, acks="all" writes need only this
    primary (its log holds them); before the spare subscribes, and without a log, they
    are refused as before."""
    for repair in (True, False):
        s: ShardSession[str] = ShardSession(
            ME, heartbeat_interval=HB, liveness=LIVENESS, min_in_sync=2, repair=repair, now=0
        )
        s.assign(Role.REPLICA, P, E, "tcp://p:1")
        s.on_map(E, {ME}, {ME})
        s.assign(Role.PRIMARY, P, E + 1)
        s.on_map(E + 1, set(), {"spare"})
        assert not s.enough_in_sync()  # the spare has not subscribed yet
        assert s.accepts_subscription("spare", P, E + 1)
        s.subscribed("spare", 40, 0.1)
        assert s.enough_in_sync() is repair and s.repairing is repair
        if repair:
            # Nothing to wait for but this copy: released as soon as it is logged.
            assert s.add_write(41, "w") == ["w"]
        assert ack(s, "spare", 41, E + 1, 0.2).in_sync  # caught up: the usual rule again
        assert s.enough_in_sync() and not s.repairing
        assert s.follower_gone("spare")
        s.on_map(E + 1, set(), set())  # lost again, no spare to load: refused
        assert not s.enough_in_sync()


def test_a_replica_that_acknowledges_without_getting_further_is_dropped() -> None:
    """A replica whose log cannot take the stream (a full disk) keeps acknowledging the
    same LSN: it is heard, but it holds the writes back for ever.  Past the liveness
    timeout without progress it leaves the in-sync set, as a silent one does; one that
    keeps up, or is merely idle, stays."""
    s = strict("r1", "r2")
    in_sync(s, "r1")
    in_sync(s, "r2")
    s.on_map(E, {"r1", "r2"}, {"r1", "r2"})
    timeout = HB * LIVENESS
    assert s.add_write(1, "w1") == []
    t, lagging = 0.0, ()
    while t < 3 * timeout and not lagging:
        t += HB
        ack(s, "r1", 0, E, t)  # stuck at LSN 0, heard every interval
        ack(s, "r2", 1, E, t)  # keeps up
        s.broker_seen(t)
        lagging = s.tick(t, requests=0, lsn=1).lagging
    assert lagging == ("r1",) and t > timeout
    assert "r2" in s.local_in_sync


def test_a_replica_the_map_dropped_is_in_sync_again_only_once_it_holds_what_was_released() -> None:
    """The broker's map drops an in-sync replica (from a report the primary has since
    superseded: the replica came back meanwhile); the writes waiting for it are released
    without it.  Its next acknowledgement, short of them, must not put it back in sync
    (the broker would record it as holding every acknowledged write, and elect it after
    a crash: sim seed 103931); it holds writes back as a joining copy until it has them."""
    s = primary("r1")
    s.on_map(E, {"r1"}, {"r1"})
    in_sync(s, "r1", lsn=5)
    assert s.add_write(6, "w6") == []  # waits for r1
    assert s.on_map(E, set(), {"r1"}).released == ["w6"]  # acknowledged without r1
    assert "r1" not in s.local_in_sync
    again = ack(s, "r1", 5, E, 0.1)
    assert not again.in_sync and "r1" not in s.local_in_sync
    assert s.add_write(7, "w7") == []  # it is joining: new writes wait for it
    back = ack(s, "r1", 6, E, 0.2)  # it holds w6, every write acknowledged: in sync
    assert back.in_sync and back.released == [] and "r1" in s.local_in_sync
    assert ack(s, "r1", 7, E, 0.3).released == ["w7"]


def test_a_rebuilt_copy_is_in_sync_only_once_it_holds_what_was_acknowledged_alone() -> None:
    """In the repair window the primary acknowledges writes on its own log.  The copy
    being rebuilt loaded a snapshot older than some of them: it is promoted-worthy (in
    sync) only once it acknowledged every one; from the moment it loaded, new writes wait
    for it."""
    s: ShardSession[str] = ShardSession(
        ME, heartbeat_interval=HB, liveness=LIVENESS, min_in_sync=2, repair=True, now=0
    )
    s.assign(Role.REPLICA, P, E, "tcp://p:1")
    s.on_map(E, {ME}, {ME})
    s.assign(Role.PRIMARY, P, E + 1)
    s.on_map(E + 1, set(), {"spare"})
    s.subscribed("spare", 40, 0.1)  # its snapshot is cut at LSN 40
    for lsn in range(41, 51):  # acknowledged alone, on this primary's log
        assert s.add_write(lsn, f"w{lsn}") == [f"w{lsn}"]
    done = ack(s, "spare", 40, E + 1, 0.2)  # loaded: not yet in sync
    assert not done.in_sync and "spare" not in s.local_in_sync
    assert s.add_write(51, "w51") == []  # new writes wait for it now
    assert not ack(s, "spare", 49, E + 1, 0.3).in_sync
    done = ack(s, "spare", 51, E + 1, 0.4)
    assert done.in_sync and done.released == ["w51"] and "spare" in s.local_in_sync


def test_a_shard_refuses_to_serve_as_primary_the_data_it_let_go() -> None:
    # Restored p0 at epoch 1 (LSN 98); a broker's assignment in flight makes it a spare
    # (the data goes); the broker that read its claim grants it p0 at epoch 1.
    s = session()
    s.restore(0, 1, 98, 0.0)
    assert s.assign(Role.SPARE, None, 0, lsn=98, term=2).changed
    refused = s.assign(Role.PRIMARY, 0, 1, lsn=0, term=3)
    assert refused.register_again and not refused.changed
    assert (s.role, s.partition) == (Role.SPARE, None)
    assert s.assign(Role.PRIMARY, 0, 1, lsn=0, term=3).register_again  # however often said
    # A primary of a newer epoch is granted knowing what it holds.
    new = s.assign(Role.PRIMARY, 0, 2, lsn=0, term=3)
    assert new.changed and not new.register_again and s.role is Role.PRIMARY


def test_the_broker_that_had_the_data_let_go_may_grant_the_partition_again() -> None:
    # It knows the shard holds none: a partition removed and made again (live
    # resharding) starts at epoch 1 again.
    s = session()
    s.assign(Role.PRIMARY, 1, 1, lsn=0)
    s.assign(Role.SPARE, None, 0, lsn=40)
    again = s.assign(Role.PRIMARY, 1, 1, lsn=0)
    assert again.changed and not again.register_again and s.role is Role.PRIMARY


def test_holding_the_partition_again_as_a_replica_ends_the_refusal() -> None:
    s = session()
    s.restore(0, 2, 98, 0.0)
    s.assign(Role.SPARE, None, 0, lsn=98, term=2)
    assert s.assign(Role.REPLICA, 0, 1, "tcp://p", lsn=0, term=3).changed
    promoted = s.assign(Role.PRIMARY, 0, 2, lsn=60, term=3)
    assert promoted.changed and not promoted.register_again


def test_a_primary_of_an_empty_partition_or_another_one_is_taken() -> None:
    s = session()
    assert s.assign(Role.PRIMARY, 0, 1, lsn=0).changed  # a new cluster: nothing let go
    s.assign(Role.SPARE, None, 0, lsn=0, term=1)  # held nothing: nothing to refuse later
    assert not s.assign(Role.PRIMARY, 0, 1, lsn=0, term=2).register_again
    s.assign(Role.SPARE, None, 0, lsn=5, term=2)
    assert not s.assign(Role.PRIMARY, 1, 1, lsn=0, term=3).register_again
