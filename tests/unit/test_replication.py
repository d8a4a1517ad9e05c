import pytest

from zps.core.replication import AckTracker, StreamCheck, check_stream


def test_without_replicas_writes_are_released_at_once() -> None:
    t: AckTracker[str] = AckTracker()
    assert t.add(1, "a") == ["a"]
    assert t.committed is None


def test_writes_wait_for_every_required_replica_in_lsn_order() -> None:
    t: AckTracker[str] = AckTracker()
    t.set_required(["r1", "r2"])
    assert t.add(1, "a") == [] and t.add(2, "b") == [] and t.add(3, "c") == []
    assert t.ack("r1", 3) == []
    assert t.ack("r2", 2) == ["a", "b"]
    assert t.ack("r2", 1) == []  # acks never go backwards
    assert t.ack("r2", 3) == ["c"]
    assert len(t) == 0


def test_dropping_a_replica_releases_what_only_it_held() -> None:
    t: AckTracker[int] = AckTracker()
    t.set_required(["r1", "r2"])
    t.add(1, 1)
    t.ack("r1", 1)
    assert t.set_required(["r1"]) == [1]
    assert "r2" not in t.acked


def test_a_caught_up_replica_is_required_from_then_on() -> None:
    t: AckTracker[int] = AckTracker()
    t.require("r1", 5)
    assert t.add(6, 6) == []
    assert t.ack("r1", 6) == [6]


def test_take_all_and_order_violations() -> None:
    t: AckTracker[int] = AckTracker()
    t.set_required(["r"])
    t.add(1, 1)
    t.add(2, 2)
    assert t.take_all() == [1, 2]
    t.add(2, 2)
    t.add(2, 3)  # a re-sent copy of a write waits for the same LSN
    with pytest.raises(ValueError):
        t.add(1, 1)
    assert t.ack("r", 2) == [2, 3]


def test_stream_check() -> None:
    def check(epoch: int, prev: int, lsn: int) -> StreamCheck:
        return check_stream(my_epoch=3, my_lsn=10, epoch=epoch, prev_lsn=prev, lsn=lsn)

    assert check(3, 10, 11) is StreamCheck.APPLY
    assert check(3, 10, 13) is StreamCheck.APPLY  # a message with three mutations
    assert check(3, 9, 10) is StreamCheck.DUPLICATE
    assert check(3, 11, 12) is StreamCheck.RESYNC  # a gap
    assert check(2, 10, 11) is StreamCheck.RESYNC
    assert check(4, 10, 11) is StreamCheck.RESYNC
