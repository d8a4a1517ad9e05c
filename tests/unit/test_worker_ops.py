"""A worker's operations pieces without processes: the watchdog's stall rule and its
pinging thread, the client meter and its exposition, and the [worker] settings."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from zps.cli.worker import check_arguments, keyword_args
from zps.errors import ConfigError
from zps.ops.config import WorkerConfig, settings_from_mapping
from zps.ops.meter import LATENCY_BUCKETS, ClientMeter
from zps.ops.metrics import client_families
from zps.ops.systemd import Notifier, client_stall


def stall(
    now: float, deadline: float | None = None, loop_turned: float | None = None
) -> str | None:
    return client_stall(now, deadline=deadline, loop_turned=loop_turned, margin=10.0)


def test_only_a_call_past_its_deadline_or_a_held_client_loop_is_a_stall() -> None:
    # nothing in flight, the loop not judged (an async function's own loop): however
    # long the function computes, no stall
    assert stall(1e6) is None
    # a call in flight, before its deadline or less than the margin after it
    assert stall(100.0, deadline=130.0) is None
    assert stall(100.0, deadline=90.0) is None
    # more than the margin after its deadline: the client no longer keeps time
    why = stall(100.0, deadline=89.0)
    assert why is not None and "11.0s after its deadline" in why
    # the blocking client's own loop must turn within the margin
    assert stall(100.0, loop_turned=90.5) is None
    why = stall(100.0, loop_turned=80.0)
    assert why is not None and "not turned for 20.0s" in why


def test_keyword_args_are_json_values_or_the_plain_string() -> None:
    got = keyword_args(
        ["lr=0.1", "epochs=3", "fast=true", "layers=[64, 32]", 'tag="3"', "data=/srv/a.csv"]
    )
    assert got == {
        "lr": 0.1,
        "epochs": 3,
        "fast": True,
        "layers": [64, 32],
        "tag": "3",
        "data": "/srv/a.csv",
    }
    assert keyword_args(["note=a=b", "empty="]) == {"note": "a=b", "empty": ""}
    for bad, what in [
        ("lr", "expected NAME=VALUE"),
        ("=1", "expected NAME=VALUE"),
        ("1x=1", "expected NAME=VALUE"),
        ("class=1", "expected NAME=VALUE"),
    ]:
        with pytest.raises(ConfigError, match=what):
            keyword_args([bad])
    with pytest.raises(ConfigError, match="--arg lr is given twice"):
        keyword_args(["lr=1", "lr=2"])


def test_arguments_are_checked_against_the_function() -> None:
    def train(ps: object, data: str, *, lr: float = 0.1, epochs: int = 1) -> None:
        pass

    check_arguments(train, "m:train", ["x"], {"lr": 0.5})
    with pytest.raises(
        ConfigError,
        match=r"m:train\(ps, data, \*, lr=0.1, epochs=1\) cannot be "
        r"called as m:train\(ps, 'x', bogus=1\): got an unexpected keyword argument 'bogus'",
    ):
        check_arguments(train, "m:train", ["x"], {"bogus": 1})
    with pytest.raises(ConfigError, match="missing a required argument: 'data'"):
        check_arguments(train, "m:train", [], {})
    with pytest.raises(ConfigError, match=r"too many positional.*flags \(--arg\) go before"):
        check_arguments(train, "m:train", ["x", "--arg", "lr=1"], {})


def test_the_pinging_thread_pings_while_healthy_and_logs_a_stall_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stuck = "a client call is still in flight 11.0s after its deadline"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify"))
        notifier = Notifier(str(tmp_path / "notify"), watchdog_period=0.02)
        state: dict[str, str | None] = {"why": None}
        answers: list[str | None] = []  # what each check said, in order
        changed = threading.Condition()

        def why() -> str | None:
            with changed:
                answers.append(state["why"])
                changed.notify_all()
                return state["why"]

        def until(n: int, value: str | None) -> None:
            with changed:
                assert changed.wait_for(lambda: answers.count(value) >= n, 5), answers

        stop = threading.Event()
        pinger = threading.Thread(target=notifier.ping_while_healthy, args=(why, stop))
        pinger.start()
        try:
            until(3, None)
            state["why"] = stuck
            until(4, stuck)
            state["why"] = None
            until(answers.count(None) + 1, None)  # healthy again
        finally:
            stop.set()
            pinger.join(5)
        assert not pinger.is_alive()
        sock.setblocking(False)
        pings = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                assert sock.recv(64) == b"WATCHDOG=1"
                pings += 1
    # one ping per healthy check, none while stalled
    assert pings == answers.count(None), (pings, answers)
    assert caplog.text.count(f"watchdog pings withheld: {stuck}") == 1  # once per stall


def test_the_pinging_thread_is_idle_outside_systemd() -> None:
    pinger = threading.Thread(
        target=Notifier().ping_while_healthy, args=(lambda: None, threading.Event())
    )
    pinger.start()
    pinger.join(1)  # returns at once: no NOTIFY_SOCKET
    assert not pinger.is_alive()


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
    assert WorkerConfig().stall_margin == 60.0
    assert settings_from_mapping({"worker": {"stall_margin": 5}}).worker.stall_margin == 5
    for bad in (
        {"stop_grace": 0},
        {"stop_grace": -1},
        {"metrics_port": 70000},
        {"stall_margin": 0},
    ):
        with pytest.raises(ConfigError, match="worker"):
            settings_from_mapping({"worker": bad})
    with pytest.raises(ConfigError, match=r"did you mean 'worker\.stop_grace'"):
        settings_from_mapping({"worker": {"stop_grac": 1}})
