"""The Prometheus endpoints of a running broker and shards, and their exposition."""

from __future__ import annotations

import math
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import zps
from zps.optim import SGD
from zps.protocol.codec import PROTOCOL_VERSION
from zps.testing import LocalCluster, free_port


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
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
    """Check the text format 0.0.4 line by line; return {family: type}.

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
        assert "zps_request_seconds_bucket" in shard
        # kill the primary: the spare becomes a replica, the broker counts a failover
        c.kill(c.shard_pid(0))
        c.wait_for(lambda s: s["failovers"] == 1 and c.healthy(s), 20, "failover and refill")
        assert value(scrape(broker_port), "zps_failovers_total") == 1
        shard = scrape(shard_port)
        assert sample(shard, "zps_shard_role", role="replica", partition="0") == 1
        assert sample(shard, "zps_shard_lsn", partition="0") >= 6


def test_every_process_exposes_valid_conventional_series(tmp_path: Path) -> None:
    bport, ports = free_port(), [free_port(), free_port()]
    c = LocalCluster(partitions=1, replication=2, workdir=tmp_path)
    c.port = free_port()
    c.broker_args = ["--metrics-port", str(bport)]
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
        primary = next(p for p in ports if sample(scrape(p), "zps_shard_role", role="primary"))
        deadline = time.monotonic() + 20
        while "zps_shard_checkpoint_age_seconds" not in scrape(primary):
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.1)

        texts = {"broker": scrape(bport), **{f"shard:{p}": scrape(p) for p in ports}}
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
            for old in ("zps_replication_lag", "zps_shard_bytes_in"):
                assert not re.search(rf"^{old}[ {{_]", text, re.M), (who, old)

        broker = texts["broker"]
        assert "zps_request_seconds" not in broker  # the broker handles no requests itself
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
        assert sample(shard, "zps_request_seconds_count", kind="write") >= 1
    finally:
        c.stop()
