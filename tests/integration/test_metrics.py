"""The Prometheus endpoints of a running broker, shards and workers, their exposition,
and the sample alert rules in deploy/ against the names they really export."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from ops_jobs import Worker
from prometheus_client.parser import text_string_to_metric_families

import zps
from zps.ops.config import Heartbeat
from zps.optim import SGD
from zps.protocol.codec import PROTOCOL_VERSION
from zps.testing import LocalCluster, free_port

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parent.parent / "deploy" / "prometheus-alerts.yml"
DASHBOARD = HERE.parent.parent / "deploy" / "grafana-dashboard.json"


#: What /metrics says it serves (zps.ops.metrics's docstring names the same version).
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"] == CONTENT_TYPE
        return r.read().decode()


def value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape")


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one series ``name`` whose labels include ``labels``."""
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, f"{len(found)} series {name}{labels} in the scrape"
    return float(found[0])


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)(?: (-?\d+))?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(?:,|$)')
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "untyped": ("",),
}
#: Non-base units and names the Prometheus conventions rule out.
_BAD_UNITS = re.compile(r"_(ms|milliseconds|us|microseconds|kb|mb|gb|kib|mib|percent)(_|$)")


def validate_exposition(text: str) -> dict[str, str]:
    """Check the text format line by line (version 1.0.0 as served: the lines of
    0.0.4); return {family: type}.

    Every sample belongs to a family declared before it (HELP and TYPE once each),
    with a suffix its type allows, valid and unique label names, a float value,
    and a series that appears once; every family has samples; counters end in
    ``_total``, nothing else does, and units are base units.
    """
    assert text.endswith("\n"), "the exposition must end with a newline"
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: Counter[str] = Counter()
    series: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for n, line in enumerate(text.splitlines(), 1):
        where = f"line {n}: {line!r}"
        assert line, f"{where}: empty line"
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(_NAME, name) and name not in helps, where
            helps.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert re.fullmatch(_NAME, name) and name not in types, where
            assert kind in _SUFFIXES, where
            assert name in helps, f"{where}: TYPE before HELP"
            types[name] = kind
            continue
        assert not line.startswith("#"), f"{where}: unknown comment"
        m = _SAMPLE.match(line)
        assert m, f"{where}: not a sample"
        name, labels_text, raw, _ = m.groups()
        family = name if name in types else None  # a "_created" family is a gauge of its own
        for f, kind in types.items():
            if family is None and any(name == f + x for x in _SUFFIXES[kind]):
                family = f
        assert family is not None, f"{where}: sample of no declared family"
        labels: list[tuple[str, str]] = []
        if labels_text:
            pos = 0
            while pos < len(labels_text):
                lm = _LABEL.match(labels_text, pos)
                assert lm, f"{where}: bad label at {labels_text[pos:]!r}"
                labels.append((lm.group(1), lm.group(2)))
                pos = lm.end()
        keys = [k for k, _ in labels]
        assert len(keys) == len(set(keys)), f"{where}: a label twice"
        assert not any(k.startswith("__") for k in keys), where
        if name.endswith("_bucket"):
            assert "le" in keys, f"{where}: a bucket without le"
        v = float(raw)  # raises on anything but a float (+Inf, NaN included)
        assert not math.isnan(v) or types[family] == "gauge", where
        key = (name, frozenset(labels))
        assert key not in series, f"{where}: the same series twice"
        series.add(key)
        samples[family] += 1
    for family, kind in types.items():
        assert samples[family] > 0, f"{family}: declared with no samples"
        base = family.removesuffix("_total")
        assert (kind == "counter") == family.endswith("_total"), f"{family} ({kind})"
        assert not base.endswith("_total"), family
        assert not _BAD_UNITS.search(family), f"{family}: not a base unit"
    # and the reference parser reads it all
    assert {f.name for f in text_string_to_metric_families(text)}
    return types


def test_broker_and_shard_export_metrics() -> None:
    broker_port, shard_port = free_port(), free_port()
    with LocalCluster(
        partitions=1, shards=2, replication=2, broker_args=["--metrics-port", str(broker_port)]
    ) as c:
        # one more shard, a spare, with its own endpoint
        c.shard_args = ["--metrics-port", str(shard_port)]
        c.start_shard()
        c.wait_for(lambda s: len(s["shards"]) == 3, 20, "the spare to register")
        with zps.connect_sync(c.address) as ps:
            ps.create_embedding("m", dim=4, optimizer=SGD(lr=0.1))
            for _ in range(5):
                ps.push_rows("m", np.arange(10), np.ones((10, 4)))
            ps.pull_rows("m", np.arange(10))
        broker = scrape(broker_port)
        assert value(broker, 'zps_broker_messages_total{outcome="routed"}') >= 7
        assert value(broker, 'zps_shards{role="primary"}') == 1
        assert value(broker, 'zps_shards{role="replica"}') == 1
        assert value(broker, 'zps_partitions{state="ok"}') == 1
        assert "zps_broker_replica_lag_updates{" in broker
        shard = scrape(shard_port)
        assert sample(shard, "zps_shard_role", role="spare", partition="none") == 1
        assert "zps_shard_request_seconds_bucket" in shard
        # kill the primary: the spare becomes a replica, the broker counts a failover
        c.kill(c.shard_pid(0))
        c.wait_for(lambda s: s["failovers"] == 1 and c.healthy(s), 20, "failover and refill")
        assert value(scrape(broker_port), "zps_failovers_total") == 1
        shard = scrape(shard_port)
        assert sample(shard, "zps_shard_role", role="replica", partition="0") == 1
        assert sample(shard, "zps_shard_lsn", partition="0") >= 6


def test_a_closed_client_sends_its_last_reports() -> None:
    """The reports since a client's last heartbeat reach the broker when it closes: a
    job's rows and steps count every report (with a heartbeat interval of a minute, none
    of them goes on a heartbeat)."""
    port = free_port()
    with LocalCluster(
        partitions=1, shards=1, replication=1, broker_args=["--metrics-port", str(port)]
    ) as c:
        with zps.connect_sync(c.address, heartbeat=Heartbeat(interval=60.0)) as ps:
            ps.create_job("last", n_records=100, per_task=10)
            while (task := ps.next_task("last")) is not None:
                ps.report(rows=task.stop - task.start, loss=0.5)
                ps.task_done(task)
        deadline = time.monotonic() + 10
        while 'zps_job_steps_total{job_name="last"}' not in (text := scrape(port)):
            assert time.monotonic() < deadline, "the closed client's reports never arrived"
            time.sleep(0.05)
        assert sample(text, "zps_job_rows_total", job_name="last") == 100
        assert sample(text, "zps_job_steps_total", job_name="last") == 10


def test_every_process_exposes_valid_conventional_series(tmp_path: Path) -> None:
    bport, ports, wport = free_port(), [free_port(), free_port()], free_port()
    c = LocalCluster(partitions=1, replication=2, workdir=tmp_path)
    c.port = free_port()
    c.broker_args = ["--metrics-port", str(bport)]
    worker: Worker | None = None
    try:
        c.start_broker()
        for i, port in enumerate(ports):
            c.start_shard(
                [
                    "--metrics-port",
                    str(port),
                    "--data-dir",
                    str(tmp_path / f"data{i}"),
                    "--checkpoint-interval",
                    "0.2",
                ]
            )
        c.wait_healthy()
        with zps.connect_sync(c.address) as ps:
            ps.create_embedding("m", dim=4, optimizer=SGD(lr=0.1))
            ps.push_rows("m", np.arange(10), np.ones((10, 4)))
            ps.pull_rows("m", np.arange(10))
            # a job with a report: the broker's per-job series (on the next heartbeat)
            ps.create_job("j", n_records=10, per_task=5)
            ps.report(rows=16, loss=0.5)
            deadline = time.monotonic() + 20
            while 'zps_job_loss{job_name="j"}' not in scrape(bport):
                assert time.monotonic() < deadline, "the report did not reach the broker"
                time.sleep(0.1)
        primary = next(p for p in ports if sample(scrape(p), "zps_shard_role", role="primary"))
        deadline = time.monotonic() + 20
        while "zps_shard_checkpoint_age_seconds" not in scrape(primary):
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.1)

        worker = Worker(c, tmp_path / "worker.log", "until_stopped", "--metrics-port", str(wport))
        worker.wait_line("ready")

        texts = {
            "broker": scrape(bport),
            **{f"shard:{p}": scrape(p) for p in ports},
            "worker": scrape(wport),
        }
        for who, text in texts.items():
            types = validate_exposition(text)
            for name, kind in [
                ("process_cpu_seconds_total", "counter"),
                ("process_resident_memory_bytes", "gauge"),
                ("process_open_fds", "gauge"),
                ("process_start_time_seconds", "gauge"),
                ("zps_build_info", "gauge"),
            ]:
                assert types.get(name) == kind, (who, name)
            build = {"version": zps.__version__, "protocol": str(PROTOCOL_VERSION)}
            assert sample(text, "zps_build_info", **build) == 1, who
            assert value(text, "process_resident_memory_bytes") > 1e6, who
            assert value(text, "process_open_fds") > 3, who
            assert abs(value(text, "process_start_time_seconds") - time.time()) < 300, who
            # renamed for the naming conventions
            for old in (
                "zps_replication_lag",
                "zps_shard_bytes_in",
                "zps_shard_bytes",
                "zps_request_seconds",
                "zps_broker_held_bytes_peak",
            ):
                assert not re.search(rf"^{old}[ {{_]", text, re.M), (who, old)

        broker = texts["broker"]
        assert "zps_shard_request_seconds" not in broker  # the broker handles no requests
        assert sample(broker, "zps_broker_replica_lag_updates", partition="0") >= 0
        shard = scrape(primary)
        assert value(shard, "zps_shard_receive_bytes_total") > 0
        assert sample(shard, "zps_shard_replica_lag_updates", partition="0") >= 0
        assert value(shard, "zps_shard_checkpoints_total") >= 1
        assert value(shard, "zps_shard_checkpoint_failures_total") == 0
        assert 0 <= sample(shard, "zps_shard_checkpoint_age_seconds", partition="0") < 60
        assert 0 < value(shard, "zps_shard_checkpoint_duration_seconds") < 60
        stamp = sample(shard, "zps_shard_checkpoint_last_success_timestamp_seconds", partition="0")
        assert abs(stamp - time.time()) < 60
        assert sample(shard, "zps_shard_request_seconds_count", kind="write") >= 1
        assert value(shard, "zps_shard_table_bytes") > 0
        # durability: the write-ahead log under --data-dir
        assert value(shard, "zps_shard_wal_bytes_total") > 0
        assert value(shard, "zps_shard_wal_syncs_total") >= 1
        assert value(shard, "zps_shard_wal_errors_total") == 0

        # the worker: its client's requests, operations and latency, and its training step
        w = scrape(wport)
        assert value(w, "zps_client_requests_total") >= 6
        assert sample(w, "zps_client_operations_total", op="push_rows") >= 3
        assert sample(w, "zps_client_operations_total", op="pull_rows") >= 3
        assert sample(w, "zps_client_request_seconds_count") >= 6
        assert sample(w, "zps_client_request_seconds_bucket", le="+Inf") >= 6
        assert 0 < value(w, "zps_client_request_seconds_sum") < 60
        assert value(w, "zps_client_payload_bytes_total") >= 3 * 16 * 4 * 4
        assert value(w, "zps_client_retries_total") == 0
        assert value(w, "zps_client_inflight_bytes") >= 0
        assert value(w, "zps_worker_step") == 3  # async mode: the clock calls it made
        assert value(w, "zps_worker_clocks_total") == 3
        assert value(w, "zps_worker_progress_age_seconds") < 5
        assert value(w, "zps_worker_stop_requested") == 0
        assert "zps_shard" not in w and "zps_broker" not in w
        with urllib.request.urlopen(f"http://127.0.0.1:{wport}/healthz", timeout=5) as r:
            assert r.read().decode().startswith("ok: the event loop turned")
        with urllib.request.urlopen(f"http://127.0.0.1:{wport}/ready", timeout=5) as r:
            assert r.read().decode().startswith("ok: running ops_jobs:until_stopped, step 3")

        # every metric an alert rule in deploy/ names is exported by one of the processes
        exported = {
            name
            for text in (*texts.values(), w)
            for family in text_string_to_metric_families(text)
            for name in (family.name, *(s.name for s in family.samples))
        }
        check_alert_rules(ALERTS, exported)
        check_dashboard(DASHBOARD, exported)
        assert sample(broker, "zps_job_rows_total", job_name="j") == 16
        assert sample(broker, "zps_job_steps_total", job_name="j") == 1
        assert sample(broker, "zps_job_tasks", job_name="j") == 2
        assert sample(broker, "zps_job_tasks_done", job_name="j") == 0
        assert value(broker, "zps_broker_peak_held_bytes") >= 0

        worker.popen.send_signal(signal.SIGTERM)
        assert worker.popen.wait(30) == 0, worker.log()
    finally:
        if worker is not None:
            worker.stop()
        c.stop()


#: PromQL words that are no metric name.
_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
#: Series Prometheus makes itself for every target.
_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels,
    keywords, strings, durations or numbers)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range durations
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _PROMQL_WORDS:
            continue  # a function call or a keyword
        names.add(m.group(0))
    return names


def check_alert_rules(path: Path, exported: set[str]) -> None:
    """``path`` is a valid rules file whose every rule selects only exported series."""
    doc = yaml.safe_load(path.read_text())
    groups = doc["groups"]
    assert groups and set(doc) == {"groups"}
    seen_alerts: set[str] = set()
    for group in groups:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"], group
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert isinstance(rule["alert"], str) and rule["alert"] not in seen_alerts
            seen_alerts.add(rule["alert"])
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule
            assert rule["annotations"]["summary"], rule
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
            names = metric_names(rule["expr"])
            assert names, rule
            unknown = names - exported - _SYNTHETIC
            assert not unknown, f"{rule['alert']}: {sorted(unknown)} exported by no process"


def check_dashboard(path: Path, exported: set[str]) -> None:
    """``path`` is a Grafana dashboard (valid JSON) whose every query selects only
    exported series, through the datasource variable."""
    doc = json.loads(path.read_text())
    assert doc["title"] and doc["uid"] and isinstance(doc["schemaVersion"], int)
    (ds,) = (v for v in doc["templating"]["list"] if v["type"] == "datasource")
    assert ds["query"] == "prometheus"
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queried: set[str] = set()
    for panel in panels:
        assert panel["title"] and set(panel["gridPos"]) == {"x", "y", "w", "h"}, panel
        assert panel["datasource"]["uid"] == "${" + ds["name"] + "}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            unknown = names - exported - _SYNTHETIC
            assert not unknown, f"{panel['title']!r}: {sorted(unknown)} exported by no process"
            queried |= names
    # the page's figures are on the dashboard too
    assert {"zps_job_loss", "zps_job_rows_total", "zps_partitions", "zps_shards"} <= queried


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="no promtool (Debian: apt-get install prometheus)"
)
def test_alert_rules_and_dashboard_queries_with_promtool(tmp_path: Path) -> None:
    """promtool parses every rule and dashboard query, and the rules fire as
    prometheus_alerts_test.yml expects (ZpsCheckpointStale before a first checkpoint)."""
    doc = json.loads(DASHBOARD.read_text())
    queries = [
        {"record": f"dashboard:panel{p['id']}:{t['refId']}", "expr": t["expr"]}
        for p in doc["panels"]
        for t in p.get("targets", [])
    ]
    rules = tmp_path / "dashboard-rules.yml"
    text = yaml.safe_dump({"groups": [{"name": "dashboard", "rules": queries}]})
    rules.write_text(text.replace("$__rate_interval", "5m"))
    for args in (
        ["check", "rules", str(ALERTS), str(rules)],
        ["test", "rules", str(HERE / "prometheus_alerts_test.yml")],
    ):
        out = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_metrics_docstring_names_the_format_served() -> None:
    import zps.ops.metrics

    version = re.search(r"version=([0-9.]+);", CONTENT_TYPE)
    assert version and f"text format version {version.group(1)}" in (
        zps.ops.metrics.__doc__ or ""
    ).replace("\n", " ")


def test_metric_names_of_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (instance, le) (rate(zps_a_bucket{job="x"}[5m])))'
        " > 1 and on (instance) process_open_fds / process_max_fds > 0.8 * 2^30 and up == 0"
    )
    assert metric_names(expr) == {"zps_a_bucket", "process_open_fds", "process_max_fds", "up"}
