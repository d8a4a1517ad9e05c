"""Clocks and data tasks of the broker, without I/O."""

from __future__ import annotations

import pytest

from zps.core.coord import Clocks, Job, JobFailed
from zps.protocol.messages import Mode


def test_ssp_holds_a_worker_more_than_tau_ahead() -> None:
    c = Clocks()
    assert c.join("a", Mode.SSP, 1) == 0 and c.join("b", Mode.SSP, 1) == 0
    c.tick("a", Mode.SSP, 1, 1)
    assert c.ssp_released() == ["a"]  # b has 0 >= 1 - 1
    c.tick("a", Mode.SSP, 1, 2)
    assert c.ssp_released() == []  # a would start step 2 while b finished none
    c.tick("b", Mode.SSP, 1, 1)
    assert sorted(c.ssp_released()) == ["a", "b"]


def test_a_leaving_worker_releases_the_others() -> None:
    c = Clocks()
    c.join("a", Mode.SSP, 0)
    c.join("b", Mode.SSP, 0)
    c.tick("a", Mode.SSP, 0, 1)
    assert c.ssp_released() == []
    c.leave("b")
    assert c.ssp_released() == ["a"]


def test_sync_commits_each_step_once_in_order() -> None:
    c = Clocks()
    c.join("a", Mode.SYNC, 0)
    c.join("b", Mode.SYNC, 0)
    c.tick("a", Mode.SYNC, 0, 1)
    assert c.sync_ready() is None  # b has not finished step 0
    c.tick("b", Mode.SYNC, 0, 1)
    assert c.sync_ready() == 0 and c.commit_workers == ("a", "b")
    assert c.sync_ready() is None  # a commit is in progress
    assert c.sync_committed(1) == []  # not the step being committed
    assert sorted(c.sync_committed(0)) == ["a", "b"]
    assert c.committed == 0 and c.sync_committed(0) == []
    assert c.join("late", Mode.SYNC, 0) == 1  # joins the open step


def test_sync_completes_without_a_dead_worker() -> None:
    c = Clocks()
    for w in "abc":
        c.join(w, Mode.SYNC, 0)
    c.tick("a", Mode.SYNC, 0, 1)
    c.tick("b", Mode.SYNC, 0, 1)
    assert c.sync_ready() is None
    c.leave("c")  # declared dead
    assert c.sync_ready() == 0 and c.commit_workers == ("a", "b")


def test_mixed_modes_are_refused() -> None:
    c = Clocks()
    c.join("a", Mode.SYNC, 0)
    with pytest.raises(ValueError, match="sync"):
        c.join("b", Mode.SSP, 2)
    with pytest.raises(ValueError, match="ssp"):
        c.tick("a", Mode.SSP, 1, 1)


def test_a_job_hands_out_every_task_once_per_epoch() -> None:
    job = Job("j", n_records=10, per_task=4, epochs=2, seed=3)
    got = []
    while (t := job.next("w")) is not None:
        got.append((t.epoch, t.start, t.stop))
        assert job.finish("w", t.task_id)
    assert job.complete and job.total == 6
    for epoch in (0, 1):
        spans = sorted((a, b) for e, a, b in got if e == epoch)
        assert spans == [(0, 4), (4, 8), (8, 10)]
    assert [e for e, _, _ in got] == [0, 0, 0, 1, 1, 1]  # epoch by epoch


def test_a_dead_worker_s_tasks_come_back_first_until_the_retry_limit() -> None:
    job = Job("j", n_records=8, per_task=4, epochs=1, max_retries=1)
    t = job.next("dead")
    assert t is not None
    assert job.worker_gone("dead") == [t.task_id]
    again = job.next("alive")
    assert again == t  # first in line
    job.worker_gone("alive")
    with pytest.raises(JobFailed, match=f"task {t.task_id}"):
        job.next("third")
    assert job.progress()["failed"]


def test_release_does_not_count_and_strangers_cannot_finish() -> None:
    job = Job("j", n_records=4, per_task=4, epochs=1, max_retries=0)
    t = job.next("a")
    assert t is not None
    assert not job.finish("b", t.task_id)
    job.release("a", t.task_id, failed=False)
    assert job.next("b") == t and job.finish("b", t.task_id)
    assert job.finish("b", t.task_id)  # a repeated report is fine
    assert job.complete and job.progress()["epochs"] == [
        {"epoch": 0, "done": 1, "running": 0, "total": 1}
    ]


def test_invalid_jobs() -> None:
    with pytest.raises(ValueError):
        Job("j", n_records=0, per_task=1, epochs=1)


def test_a_join_after_a_restore_starts_above_what_the_ticks_prove() -> None:
    """A restored record may be older than what the workers saw (releases are not
    written before they are sent): a tick that finishes step 7 proves step 6 was
    committed, so a worker joining then starts at step 7, not at the record's."""
    from zps.core.brokerstate import ClockRecord

    rec = ClockRecord(
        mode=Mode.SYNC,
        tau=0,
        workers=(("a", 2, False),),
        committed=1,
        committing=None,
        commit_workers=("a",),
    )
    c = Clocks.from_record(rec)
    assert Clocks.from_record(rec).join("b", Mode.SYNC, 0) == 2  # nothing heard yet
    c.tick("a", Mode.SYNC, 0, 8)
    assert c.join("b", Mode.SYNC, 0) == 7
