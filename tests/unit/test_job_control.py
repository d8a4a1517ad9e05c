"""Job control without I/O: states, cancel, reset, create of a finished job, restart,
and what a broker record keeps of them."""

from __future__ import annotations

import pytest

from zps.core.brokerstate import BrokerState, JobRecord, PartitionRecord
from zps.core.coord import Job, JobFailed
from zps.protocol.messages import OPERATOR_TASK_OPS, TaskRequest


def _drain(job: Job, worker: str = "w") -> list[int]:
    out = []
    while (t := job.next(worker)) is not None:
        assert job.finish(worker, t.task_id)
        out.append(t.task_id)
    return out


def test_states_from_pending_to_complete() -> None:
    job = Job("j", 10, 5, epochs=2)
    assert job.state() == "pending" and job.epoch() == 0 and not job.finished
    t = job.next("w")
    assert t is not None and job.state() == "running"
    job.finish("w", t.task_id)
    _drain(job)
    assert job.state() == "complete" and job.finished and job.epoch() == 2
    p = job.progress()
    assert (p["state"], p["epoch"], p["n_epochs"], p["done"], p["total"]) == (
        "complete",
        2,
        2,
        4,
        4,
    )


def test_cancel_hands_out_nothing_and_lets_held_tasks_finish() -> None:
    job = Job("j", 10, 2, 1)
    held = job.next("a")
    assert held is not None
    job.cancel()
    assert job.next("b") is None and job.state() == "cancelled" and job.finished
    assert job.finish("a", held.task_id)  # the task held goes on and counts
    assert len(job.done) == 1 and job.state() == "cancelled"


def test_reset_runs_everything_again_and_orphans_held_tasks() -> None:
    job = Job("j", 6, 2, 1, max_retries=0)
    first = job.next("a")
    second = job.next("b")
    assert first is not None and second is not None
    job.finish("a", first.task_id)
    job.reset()
    assert job.state() == "pending" and not job.done and len(job.queue) == job.total
    # b's report of a task of the previous run is accepted and counts for nothing
    assert job.finish("b", second.task_id)
    assert not job.done and job.orphaned == set()
    # a stranger's report is still refused
    assert not job.finish("c", second.task_id)
    assert sorted(_drain(job)) == list(range(job.total))
    assert job.state() == "complete"


def test_reset_clears_a_failure_and_a_cancel() -> None:
    job = Job("j", 4, 2, 1, max_retries=0)
    t = job.next("a")
    assert t is not None
    job.release("a", t.task_id, failed=True)
    with pytest.raises(JobFailed):
        job.next("a")
    job.reset()
    assert job.state() == "pending" and job.retries == {}
    job.cancel()
    job.reset()
    assert job.next("a") is not None


def test_create_of_an_existing_job() -> None:
    job = Job("j", 4, 2, 1)
    assert job.create(job.spec(), restart=False) == "exists"
    assert job.create(job.spec(), restart=True) == "exists"  # not finished: no reset
    with pytest.raises(ValueError) as refused:
        job.create((8, 2, 1, 3, 0), restart=False)
    assert str(refused.value) == "job 'j' exists with other settings: n_records 4 (asked 8)"
    with pytest.raises(ValueError, match=r"per_task 2 \(asked 3\), seed 0 \(asked 7\)$"):
        job.create((4, 3, 1, 3, 7), restart=False)
    _drain(job)
    assert job.create(job.spec(), restart=False) == "finished"
    assert job.state() == "complete"
    with pytest.raises(ValueError, match="restart=True runs it again"):
        job.create((8, 2, 1, 3, 0), restart=False)
    assert job.create((8, 2, 1, 3, 0), restart=True) == "restarted"
    assert job.spec() == (8, 2, 1, 3, 0) and job.total == 4 and job.state() == "pending"
    assert len(_drain(job)) == 4


def test_a_cancelled_and_reset_job_survives_a_record() -> None:
    job = Job("j", 6, 2, 1)
    held = job.next("a")
    assert held is not None
    job.reset()
    job.next("b")
    job.cancel()
    rec = job.to_record()
    state = BrokerState(1, 1, 16, 1, 1, (PartitionRecord(),), jobs=(rec,))
    back = BrokerState.from_bytes(state.to_bytes()).jobs[0]
    assert back == rec
    again = Job.from_record(back)
    assert again.cancelled and again.orphaned == {(held.task_id, "a")}
    assert again.next("c") is None
    assert again.finish("a", held.task_id) and len(again.done) == 0


def test_a_record_without_job_control_fields_reads() -> None:
    rec = JobRecord("j", 4, 2, 1, 3, 0, queue=(0, 1))
    raw = BrokerState(1, 1, 16, 1, 1, (PartitionRecord(),), jobs=(rec,)).to_dict()
    for j in raw["jobs"]:
        del j["cancelled"], j["orphaned"]
    back = BrokerState.from_dict(raw).jobs[0]
    assert not back.cancelled and back.orphaned == ()


def test_operator_only_requests() -> None:
    assert {"cancel", "reset"} == OPERATOR_TASK_OPS
    assert TaskRequest.parse({"op": "cancel", "job": "j"}).operator_only
    assert TaskRequest.parse({"op": "reset", "job": "j"}).operator_only
    restart = {"op": "create", "job": "j", "n_records": 4, "per_task": 2, "restart": True}
    assert TaskRequest.parse(restart).operator_only
    assert not TaskRequest.parse({**restart, "restart": False}).operator_only
    assert not TaskRequest.parse({"op": "list"}).operator_only
    assert not TaskRequest.parse({"op": "show", "job": "j"}).operator_only
