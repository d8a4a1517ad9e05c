"""A worker's operations pieces without processes: the watchdog's progress rule, the
client meter and its exposition, and the [worker] settings."""

from __future__ import annotations

import asyncio
import math
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from zps.errors import ConfigError
from zps.ops.config import WorkerConfig, settings_from_mapping
from zps.ops.meter import LATENCY_BUCKETS, ClientMeter
from zps.ops.metrics import Metric, client_families
from zps.ops.systemd import Notifier, progress_ping_due

P = 5.0  # the ping period: half of WatchdogSec = 10 s


def due(now: float, *, last_ping: float, last_progress: float, waiting: bool = False) -> bool:
    return progress_ping_due(
        P, now, last_ping=last_ping, last_progress=last_progress, waiting=waiting
    )


def test_pings_need_recent_progress_or_a_call_in_flight() -> None:
    assert not progress_ping_due(None, 100.0, last_ping=0.0, last_progress=100.0, waiting=True)
    # progress within the last period: ping
    assert due(100.0, last_ping=90.0, last_progress=96.0)
    assert due(100.0, last_ping=90.0, last_progress=95.0)
    # none for longer than a period, and no call in flight: the function hangs
    assert not due(100.0, last_ping=90.0, last_progress=94.9)
    assert not due(1000.0, last_ping=90.0, last_progress=0.0)
    # waiting in a call (a clock call waiting for the other workers) is progress
    assert due(1000.0, last_ping=90.0, last_progress=0.0, waiting=True)
    # at most one ping per half period
    assert not due(100.0, last_ping=97.6, last_progress=100.0, waiting=True)
    assert due(100.0, last_ping=97.5, last_progress=100.0)
    assert due(100.0, last_ping=-math.inf, last_progress=100.0)


def test_a_step_without_calls_up_to_watchdog_sec_survives_a_longer_one_does_not() -> None:
    """Checked every half period, the longest gap between pings is at most the longest
    stretch without progress: under WatchdogSec (2 P) nothing is restarted."""

    def longest_gap(step: float, offset: float = 0.3) -> float:
        """Pings of a function that makes a call every ``step`` seconds (from ``offset``)."""
        last_ping, gaps, t = 0.0, [], 0.0
        while t < 120:
            last_progress = offset + step * math.floor((t - offset) / step)
            if due(t, last_ping=last_ping, last_progress=last_progress):
                gaps.append(t - last_ping)
                last_ping = t
            t += P / 2
        return max(gaps)

    assert longest_gap(1.0) <= P / 2
    assert longest_gap(9.0) < 2 * P  # a 9 s step with WatchdogSec = 10: no restart
    assert longest_gap(9.9, offset=2.4) < 2 * P
    assert longest_gap(25.0) > 2 * P  # 25 s without a call: systemd restarts it


def test_progress_watchdog_loop_pings_while_progress_and_logs_a_stall(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify"))
        sock.setblocking(False)
        notifier = Notifier(str(tmp_path / "notify"), watchdog_period=0.04)
        state = {"last": 0.0, "waiting": False}

        def progress() -> tuple[float, bool]:
            return state["last"], state["waiting"]

        def drain() -> int:
            n = 0
            while True:
                try:
                    assert sock.recv(64) == b"WATCHDOG=1"
                    n += 1
                except BlockingIOError:
                    return n

        async def scenario() -> tuple[int, int, int]:
            import time

            task = asyncio.create_task(notifier.progress_watchdog_loop(progress))
            for _ in range(10):  # progress all along
                state["last"] = time.monotonic()
                await asyncio.sleep(0.02)
            active = drain()
            await asyncio.sleep(0.2)  # hung: no progress, no call
            drain()  # pings allowed just after the last progress
            await asyncio.sleep(0.2)
            hung = drain()
            state["waiting"] = True  # waiting in a call again
            await asyncio.sleep(0.2)
            waiting = drain()
            task.cancel()
            return active, hung, waiting

        active, hung, waiting = asyncio.run(scenario())
        assert active >= 2 and hung == 0 and waiting >= 2, (active, hung, waiting)
        assert "made no progress" in caplog.text
        assert caplog.text.count("made no progress") == 1  # once per stall


def test_progress_watchdog_loop_is_idle_outside_systemd() -> None:
    async def run() -> None:
        await asyncio.wait_for(Notifier().progress_watchdog_loop(lambda: (0.0, False)), 1)

    asyncio.run(run())  # returns at once: no NOTIFY_SOCKET


def test_client_meter_counts_requests_latency_and_progress() -> None:
    m = ClientMeter(now=10.0)
    assert m.progress() == (10.0, False)
    m.request_sent(["push_rows", "pull_rows", "push_rows"], 300, now=11.0)
    assert m.progress() == (11.0, True)
    assert (m.inflight, m.inflight_bytes, m.payload_bytes) == (1, 300, 300)
    m.request_done(300, 0.003, now=12.0)
    m.request_sent(["pull_rows"], 100, now=12.5)
    m.request_done(100, 7.0, now=13.0)
    assert m.progress() == (13.0, False)
    assert (m.inflight, m.inflight_bytes, m.payload_bytes) == (0, 0, 400)
    assert m.operations == {"push_rows": 2, "pull_rows": 2}
    buckets, total = m.latency()
    assert total == pytest.approx(7.003)
    assert len(buckets) == len(LATENCY_BUCKETS) + 1 and buckets[-1] == ("+Inf", 2.0)
    le = dict(buckets)
    assert le["0.0025"] == 0 and le["0.005"] == 1 and le["2.5"] == 1
    m.call_started(now=14.0)
    assert m.progress() == (14.0, True)
    m.call_done(now=20.0)
    m.clocked(5.5, now=21.0)
    m.stepped(now=22.0)
    assert (m.clocks, m.clock_wait_seconds, m.progress()) == (1, 5.5, (22.0, False))


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def test_client_families_are_valid_conventional_series() -> None:
    m = ClientMeter(now=0.0)
    m.request_sent(["push_rows"], 64, now=1.0)
    m.request_done(64, 0.01, now=1.5)
    m.clocked(0.25, now=2.0)
    registry = CollectorRegistry(auto_describe=False)
    families = list(
        client_families(m, requests=1, retries=2, step=4, stop_requested=True, now=12.0)
    )
    registry.register(_Fixed(families))
    text = generate_latest(registry).decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {name: f.type for name, f in parsed.items()}
    assert kinds == {
        "zps_client_request_seconds": "histogram",
        "zps_client_requests": "counter",
        "zps_client_operations": "counter",
        "zps_client_payload_bytes": "counter",
        "zps_client_retries": "counter",
        "zps_client_inflight_requests": "gauge",
        "zps_client_inflight_bytes": "gauge",
        "zps_client_broker_calls_in_progress": "gauge",
        "zps_worker_step": "gauge",
        "zps_worker_clocks": "counter",
        "zps_worker_clock_wait_seconds": "counter",
        "zps_worker_progress_age_seconds": "gauge",
        "zps_worker_stop_requested": "gauge",
    }
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in parsed.values()
        for s in f.samples
    }
    assert values[("zps_client_request_seconds_count", ())] == 1
    assert values[("zps_client_request_seconds_bucket", (("le", "0.01"),))] == 1
    assert values[("zps_client_request_seconds_bucket", (("le", "0.005"),))] == 0
    assert values[("zps_client_operations_total", (("op", "push_rows"),))] == 1
    assert values[("zps_client_retries_total", ())] == 2
    assert values[("zps_worker_step", ())] == 4
    assert values[("zps_worker_progress_age_seconds", ())] == 10.0
    assert values[("zps_worker_stop_requested", ())] == 1
    # no operation sent yet: that family is left out, not declared empty
    fresh = list(
        client_families(
            ClientMeter(0.0), requests=0, retries=0, step=0, stop_requested=False, now=0
        )
    )
    assert "zps_client_operations" not in {f.name for f in fresh}


def test_worker_settings() -> None:
    assert WorkerConfig().stop_grace == 10.0 and WorkerConfig().metrics_port == 0
    s = settings_from_mapping({"worker": {"stop_grace": 2.5, "metrics_port": 9105}})
    assert (s.worker.stop_grace, s.worker.metrics_port) == (2.5, 9105)
    for bad in ({"stop_grace": 0}, {"stop_grace": -1}, {"metrics_port": 70000}):
        with pytest.raises(ConfigError, match="worker"):
            settings_from_mapping({"worker": bad})
    with pytest.raises(ConfigError, match=r"did you mean 'worker\.stop_grace'"):
        settings_from_mapping({"worker": {"stop_grac": 1}})
