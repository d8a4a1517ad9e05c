"""The status page's pure parts: the report history of the broker, ETAs, the heartbeat's
training report, the page's rendering, and how the HTTP thread gets the report from
the event loop."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from zps.broker.training import TrainingReports, epoch_eta
from zps.errors import ProtocolError
from zps.ops import metrics
from zps.ops.config import Metrics
from zps.ops.page import render, ticks
from zps.protocol.messages import Heartbeat, TrainReport


def report(
    job: str = "j", rows: float = 100, secs: float = 1.0, loss: float | None = 1.0
) -> TrainReport:
    return TrainReport(job, rows, secs, 1, loss)


def test_history_sums_workers_rates_and_averages_their_loss() -> None:
    r = TrainingReports(points=10, period=1.0)
    r.add("w1", report(rows=100, secs=1.0, loss=2.0), now=100.0)
    r.add("w2", report(rows=50, secs=0.5, loss=4.0), now=100.2)
    r.add("w1", report(rows=100, secs=1.0, loss=None), now=100.5)
    r.add("w1", report(rows=300, secs=1.0, loss=1.0), now=101.0)  # opens the next point
    h = r.history()["j"]
    assert h["t"] == [100.0, 101.0]
    # w1: 200 rows in 2 s, w2: 50 rows in 0.5 s -> 100 + 100 rows/s
    assert h["rows_per_s"] == [200.0, 300.0]
    assert h["loss"] == [3.0, 1.0]
    assert r.totals()["j"] == (550.0, 4, 1.0)


def test_history_is_bounded_by_merging_neighbours() -> None:
    r = TrainingReports(points=8, period=1.0)
    for i in range(100):
        r.add("w", report(rows=10.0 * i, loss=float(i)), now=1000.0 + i)
    h = r.history()["j"]
    assert 4 <= len(h["t"]) <= 8
    assert h["period_s"] > 1.0
    assert h["t"] == sorted(h["t"]) and h["t"][0] == 1000.0
    assert h["loss"][0] < h["loss"][-1]  # the shape survives the merging
    assert r.totals()["j"][0] == sum(10.0 * i for i in range(100))


def test_history_keeps_the_most_recently_reported_jobs() -> None:
    r = TrainingReports(points=4, jobs=2)
    r.add("w", report("a"), now=1.0)
    r.add("w", report("b"), now=2.0)
    r.add("w", report("a"), now=3.0)
    r.add("w", report("c"), now=4.0)
    assert set(r.history()) == {"a", "c"}


def test_reports_refuse_bad_bounds() -> None:
    with pytest.raises(ValueError, match="points >= 2"):
        TrainingReports(points=1)


def test_epoch_eta() -> None:
    assert epoch_eta(10, 10, None, 5.0) == 0.0
    assert epoch_eta(0, 10, (0.0, 0), 5.0) is None  # nothing done yet: no pace
    assert epoch_eta(5, 10, None, 5.0) is None
    assert epoch_eta(5, 10, (0.0, 0), 5.0) == pytest.approx(5.0)
    assert epoch_eta(6, 10, (2.0, 2), 6.0) == pytest.approx(4.0)  # restored with 2 done


def test_train_report_on_the_wire() -> None:
    beat = Heartbeat(TrainReport("j", 16.0, 0.2, 3, 0.5))
    assert Heartbeat.parse(beat.to_wire()) == beat
    assert Heartbeat.parse({}) == Heartbeat() and Heartbeat().to_wire() == {}
    bad: list[tuple[Any, str]] = [
        (1, "must be a map"),
        ({"job": "j", "rows": -1, "secs": 1, "steps": 1}, ">= 0"),
        ({"job": "", "rows": 1, "secs": 1, "steps": 1}, "job must be a non-empty string"),
        ({"job": "j", "rows": 1, "secs": 1, "steps": 1, "loss": float("nan")}, "loss must be"),
        ({"job": "j", "rows": 1, "secs": 1}, "missing 'steps'"),
        ({"job": "j", "rows": True, "secs": 1, "steps": 1}, "rows must be a finite number"),
    ]
    for train, message in bad:
        with pytest.raises(ProtocolError, match=message):
            Heartbeat.parse({"train": train})


def test_ticks_are_round_and_cover_the_range() -> None:
    assert ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    assert ticks(0, 370) == [0, 100, 200, 300, 400]
    t = ticks(0.13, 0.71)
    assert t[0] <= 0.13 and t[-1] >= 0.71 and len(t) <= 6
    assert ticks(5, 5)[0] <= 5 <= ticks(5, 5)[-1]  # a flat series still gets an axis


def minimal_report(**extra: Any) -> dict[str, Any]:
    return {
        "map_version": 3,
        "n_partitions": 1,
        "replication": 1,
        "failovers": 0,
        "partitions": [
            {"partition": 0, "state": "lost", "primary": None, "replicas": [], "lsn": None}
        ],
        "shards": [],
        "clients": [],
        "training": {"jobs": [], "history": {}, "workers": {}, "mode": None},
        "broker": {"endpoint": "tcp://b:1", "version": "0", "uptime_s": 5},
        **extra,
    }


def test_page_escapes_what_peers_named() -> None:
    evil = '<img src=x onerror="alert(1)">'
    page = render(
        minimal_report(
            shards=[{"node": evil, "host": evil, "role": "spare", "stats": {}, "lsn": 0}],
            training={
                "jobs": [],
                "workers": {},
                "history": {evil: {"t": [1.0, 2.0], "loss": [1.0, 0.5], "rows_per_s": [1, 2]}},
            },
        )
    )
    assert evil not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    assert '<span class="pill lost">lost</span>' in page  # the cluster's worst state
    assert 'data-series="loss" data-points="2"' in page


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_status_is_built_on_the_loop_once_per_max_age(loop: asyncio.AbstractEventLoop) -> None:
    built: list[threading.Thread] = []

    def status() -> dict[str, Any]:
        built.append(threading.current_thread())
        return {"n": len(built)}

    server = metrics.MetricsServer(Metrics(port=0), lambda: [], status=status)
    with pytest.raises(metrics.StatusUnavailable, match="has not started"):
        server.status_json()
    asyncio.run_coroutine_threadsafe(_adopt(server), loop).result(5)
    assert server.status_json(now=0.0) == b'{"n": 1}'
    assert server.status_json() == b'{"n": 1}'  # younger than STATUS_MAX_AGE_S
    assert built == [_loop_thread(loop)]


def test_a_stalled_loop_gets_a_503_not_a_hang(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "STATUS_TIMEOUT_S", 0.2)
    server = metrics.MetricsServer(Metrics(port=0), lambda: [], status=lambda: {})
    asyncio.run_coroutine_threadsafe(_adopt(server), loop).result(5)
    release = threading.Event()
    loop.call_soon_threadsafe(release.wait, 10)  # the loop blocks
    began = time.monotonic()
    try:
        with pytest.raises(metrics.StatusUnavailable, match=r"did not answer within 0\.2s"):
            server.status_json()
    finally:
        release.set()
    assert time.monotonic() - began < 5


def test_a_loop_that_stops_before_building_leaves_nothing_unawaited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A viewer's request that the loop never ran (the process stopping) leaves no
    coroutine behind to be collected un-awaited."""
    monkeypatch.setattr(metrics, "STATUS_TIMEOUT_S", 0.2)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = metrics.MetricsServer(Metrics(port=0), lambda: [], status=lambda: {})
    asyncio.run_coroutine_threadsafe(_adopt(server), loop).result(5)
    release = threading.Event()

    def block_then_stop() -> None:
        release.wait(10)
        loop.stop()  # the build queued meanwhile never runs

    loop.call_soon_threadsafe(block_then_stop)
    try:
        with pytest.raises(metrics.StatusUnavailable, match="did not answer"):
            server.status_json()
    finally:
        release.set()
        thread.join(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.close()
        del server
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], caught


async def _adopt(server: metrics.MetricsServer) -> None:
    """What loop_heartbeat does first: the server learns its event loop."""
    task = asyncio.ensure_future(server.loop_heartbeat())
    await asyncio.sleep(0)
    task.cancel()


def _loop_thread(loop: asyncio.AbstractEventLoop) -> threading.Thread:
    return asyncio.run_coroutine_threadsafe(_current(), loop).result(5)


async def _current() -> threading.Thread:
    return threading.current_thread()


def test_a_report_the_page_cannot_show_is_a_500_naming_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    import urllib.error
    import urllib.request

    from zps.testing import free_port

    server = metrics.MetricsServer(
        Metrics(port=free_port()), lambda: [], status=lambda: {"partitions": 3}
    )
    asyncio.run_coroutine_threadsafe(_adopt(server), loop).result(5)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(base + "/status.json", timeout=5) as r:
            assert r.read() == b'{"partitions": 3}'
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/", timeout=5)
        assert e.value.code == 500
        assert e.value.read().startswith(b"the status page failed: TypeError")
    finally:
        server.stop()


def test_an_epochs_eta_starts_again_when_its_job_is_reset() -> None:
    from zps.broker.training import Training
    from zps.core.cluster import ClusterState
    from zps.protocol.codec import MsgType, Route
    from zps.protocol.messages import JobSettings, TaskRequest

    async def send(frames: list[Any]) -> bool:
        return True

    async def run() -> list[Any]:
        training = Training(ClusterState(1, 16), send)
        route = Route(MsgType.TASK, req_id=1)
        settings = JobSettings(n_records=100, per_task=10)
        await training.on_task(b"w", "w", route, TaskRequest("create", "j", settings=settings))

        async def take_and_finish() -> None:
            nonlocal route
            route = Route(MsgType.TASK, req_id=route.req_id + 1)
            await training.on_task(b"w", "w", route, TaskRequest("next", "j", wait=False))
            task = training.jobs["j"].held
            (tid,) = list(task)
            route = Route(MsgType.TASK, req_id=route.req_id + 1)
            await training.on_task(b"w", "w", route, TaskRequest("done", "j", task=tid))

        for _ in range(3):
            await take_and_finish()
        before = training.epoch_start("j", 0)
        training.jobs["j"].reset()
        await take_and_finish()
        return [before, training.epoch_start("j", 0), training.status()["jobs"][0]]

    before, after, progress = asyncio.run(run())
    assert after[0] > before[0] and after[1] == 0  # a fresh start, nothing done then
    assert progress["epochs"][0]["done"] == 1 and progress["epochs"][0]["eta_s"] is not None
