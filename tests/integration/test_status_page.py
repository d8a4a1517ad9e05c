"""The broker's live status page (``/``) and ``/status.json`` on a running cluster: read
over plain HTTP, and loaded in a real headless browser (Debian's ``chromium``) that
runs the page's script, whose DOM is checked and whose screenshot is saved."""

from __future__ import annotations

import html
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.testing import LocalCluster, free_port

JOB = "ctr-train"
#: Tasks finished by the fixture's worker: all of epoch 0, half of epoch 1.
TASKS_DONE = 30


def get(port: int, path: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.headers["Content-Type"], r.read()


def status_json(port: int) -> dict[str, Any]:
    code, ctype, body = get(port, "/status.json")
    assert code == 200 and ctype == "application/json"
    report: dict[str, Any] = json.loads(body)
    return report


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[LocalCluster, int, Any]]:
    """A cluster of 2 partitions x 2 copies whose broker serves the page, and a
    connected client that created a 2-epoch job and trained 30 of its 40 tasks,
    reporting a falling loss, over about 3 seconds."""
    port = free_port()
    with (
        LocalCluster(
            partitions=2, shards=4, replication=2, broker_args=["--metrics-port", str(port)]
        ) as c,
        zps.connect_sync(c.address) as ps,
    ):
        ps.create_embedding("emb", dim=8, optimizer=SGD(lr=0.1))
        ps.create_job(JOB, n_records=1000, per_task=50, epochs=2)
        for i in range(TASKS_DONE):
            task = ps.next_task(JOB)
            assert task is not None
            ps.push_rows(
                "emb", np.arange(task.start % 100, task.start % 100 + 50), np.ones((50, 8))
            )
            ps.report(rows=50, loss=2.0 / (1 + i) + 0.1)
            ps.task_done(task)
            time.sleep(0.1)  # the pace of training, so the history spans seconds
        # the last reports reach the broker on the client's next heartbeat
        steps = f'zps_job_steps_total{{job_name="{JOB}"}} {TASKS_DONE}.0'
        deadline = time.monotonic() + 10
        while steps not in get(port, "/metrics")[2].decode():
            assert time.monotonic() < deadline, f"the broker did not get every report of {JOB}"
            time.sleep(0.1)
        yield c, port, ps


def test_status_json_is_the_status_report_with_the_history(
    trained: tuple[LocalCluster, int, Any],
) -> None:
    c, port, _ = trained
    report = status_json(port)
    cli = c.status()  # what `zps-server status --json` prints
    assert set(report) == set(cli)
    assert [(p["partition"], p["primary"], p["state"]) for p in report["partitions"]] == [
        (p["partition"], p["primary"], p["state"]) for p in cli["partitions"]
    ]
    assert {s["node"] for s in report["shards"]} == {s["node"] for s in cli["shards"]}
    assert all(p["state"] == "ok" for p in report["partitions"])

    (job,) = report["training"]["jobs"]
    assert (job["job"], job["done"], job["total"]) == (JOB, TASKS_DONE, 40)
    e0, e1 = job["epochs"]
    assert (e0["done"], e0["eta_s"]) == (20, 0.0)
    assert e1["done"] == 10 and e1["eta_s"] is not None and 0 < e1["eta_s"] < 60

    h = report["training"]["history"][JOB]
    assert len(h["t"]) == len(h["loss"]) == len(h["rows_per_s"]) >= 3
    assert h["t"] == sorted(h["t"]) and abs(h["t"][-1] - time.time()) < 60
    losses = [v for v in h["loss"] if v is not None]
    assert losses[0] > losses[-1] > 0.1  # the falling loss the worker reported
    # 50 rows a step, a step about every 0.1 s (and its requests): tens to hundreds a second
    assert all(0 < r < 2000 for r in h["rows_per_s"][:-1]), h["rows_per_s"]

    # the same figures in /metrics, per job
    _, _, metrics = get(port, "/metrics")
    text = metrics.decode()
    assert f'zps_job_rows_total{{job_name="{JOB}"}} {TASKS_DONE * 50}.0' in text
    assert f'zps_job_steps_total{{job_name="{JOB}"}} {TASKS_DONE}.0' in text
    assert re.search(rf'^zps_job_loss{{job_name="{JOB}"}} 0\.1[0-9]*$', text, re.M), text
    assert f'zps_job_tasks_done{{job_name="{JOB}"}} {TASKS_DONE}.0' in text


def test_page_is_served_rendered_and_survives_a_stalled_reader(
    trained: tuple[LocalCluster, int, Any],
) -> None:
    c, port, _ = trained
    # a client that opens a connection and never finishes its request holds a thread
    # of the HTTP server, not the broker's event loop
    stalled = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        stalled.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n")
        code, ctype, body = get(port, "/")
        assert c.status()["map_version"] >= 1  # the broker still answers its clients
    finally:
        stalled.close()
    assert code == 200 and ctype == "text/html; charset=utf-8"
    page = body.decode()
    report = status_json(port)
    for p in report["partitions"]:
        assert f'data-partition="{p["partition"]}"' in page
        assert html.escape(p["primary"]) in page
    for s in report["shards"]:
        assert f'data-shard="{s["node"]}"' in page
    assert f'data-job="{JOB}"' in page
    loss = re.search(r'<svg class="chart loss" data-series="loss" data-points="(\d+)"', page)
    assert loss and int(loss.group(1)) >= 3
    assert "<script>" in page and "status.json" in page  # the live refresh
    with pytest.raises(urllib.error.HTTPError) as e:
        get(port, "/nope")
    assert e.value.code == 404 and b"/status.json" in e.value.read()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browse(binary: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",  # tests may run as root
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--virtual-time-budget=5000",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (apt-get install chromium)")
def test_page_in_a_headless_browser(trained: tuple[LocalCluster, int, Any], tmp_path: Path) -> None:
    _, port, _ = trained
    binary = _chromium()
    assert binary is not None
    url = f"http://127.0.0.1:{port}/"
    out = _browse(binary, url, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom")
    assert "<html" in out.stdout, out.stderr[-2000:]
    dom = re.sub(r"<script>.*?</script>", "", out.stdout, flags=re.S)  # the markup only
    # the script ran: it fetched /status.json and drew the page again
    drawn = re.search(r'<body[^>]* data-drawn="(\d+)"', dom)
    assert drawn and int(drawn.group(1)) >= 1, dom[:2000]
    report = status_json(port)
    rows = re.findall(r'<tr data-partition="(\d+)">', dom)
    assert rows == [str(p["partition"]) for p in report["partitions"]]
    assert sorted(re.findall(r'<tr data-shard="([^"]+)">', dom)) == sorted(
        s["node"] for s in report["shards"]
    )
    assert dom.count('<span class="pill primary">primary</span>') == 2
    assert dom.count('<span class="pill replica">replica</span>') == 2
    assert f'data-job="{JOB}"' in dom
    loss = re.search(r'<svg class="chart loss" data-series="loss" data-points="(\d+)"', dom)
    assert loss and int(loss.group(1)) >= 3, dom
    chart = dom[loss.start() : dom.index("</svg>", loss.start())]
    assert re.search(r'<path class="line" d="M[\d.]+,[\d.]+( L[\d.]+,[\d.]+){2,}"', chart)
    assert chart.count('class="tick"') >= 6  # labelled axes
    assert re.search(r'<tr data-epoch="1">.*?<span class="pill running">', dom, re.S)

    shot = tmp_path / "status-page.png"
    out = _browse(
        binary,
        url,
        f"--user-data-dir={tmp_path / 'profile2'}",
        f"--screenshot={shot}",
        "--window-size=1280,1700",
    )
    assert shot.exists(), out.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def synthetic_report(now: float) -> dict[str, Any]:
    """A report with what a small healthy cluster does not show: a broker pair, a lost
    and a degraded partition, a lagging replica, a drained shard, a job of three epochs."""
    shard = {"host": "h1", "lsn": 120, "last_seen_s": 0.1, "stats": {"requests": 9, "nbytes": 4096}}
    return {
        "map_version": 9,
        "n_partitions": 3,
        "replication": 2,
        "failovers": 2,
        "partitions": [
            {
                "partition": 0,
                "state": "ok",
                "primary": "s-a",
                "lsn": 120,
                "epoch": 2,
                "slots": 8,
                "replicas": [{"node": "s-b", "in_sync": True, "lsn": 120, "lag": 0}],
            },
            {
                "partition": 1,
                "state": "degraded",
                "primary": "s-c",
                "lsn": 90,
                "epoch": 3,
                "slots": 8,
                "replicas": [{"node": "s-d", "in_sync": False, "lsn": 40, "lag": 50}],
            },
            {
                "partition": 2,
                "state": "lost",
                "primary": None,
                "lsn": None,
                "epoch": 1,
                "slots": 8,
                "replicas": [],
            },
        ],
        "shards": [
            {**shard, "node": "s-a", "role": "primary", "partition": 0},
            {**shard, "node": "s-b", "role": "replica", "partition": 0},
            {**shard, "node": "s-c", "role": "primary", "partition": 1},
            {**shard, "node": "s-d", "role": "replica", "partition": 1},
            {**shard, "node": "s-e", "role": "spare", "partition": None, "drained": True},
        ],
        "clients": [{"node": "c-1", "name": "trainer", "host": "h2", "pid": 7, "last_seen_s": 0}],
        "training": {
            "mode": "sync",
            "committed_step": 41,
            "workers": {"c-1": 42},
            "jobs": [
                {
                    "job": "j",
                    "records": 600,
                    "per_task": 20,
                    "done": 25,
                    "total": 30,
                    "running": 2,
                    "retried": 1,
                    "failed": None,
                    "epochs": [
                        {"epoch": 0, "done": 10, "running": 0, "total": 10, "eta_s": 0.0},
                        {"epoch": 1, "done": 10, "running": 0, "total": 10, "eta_s": 0.0},
                        {"epoch": 2, "done": 5, "running": 2, "total": 10, "eta_s": 75.0},
                    ],
                },
            ],
            "history": {
                "j": {
                    "t": [now - 30 + i for i in range(30)],
                    "loss": [None if i == 3 else 1.5 / (1 + i) for i in range(30)],
                    "rows_per_s": [900.0 + 10 * i for i in range(30)],
                    "period_s": 1.0,
                },
                "orphan": {"t": [now], "loss": [0.5], "rows_per_s": [10.0], "period_s": 1.0},
            },
        },
        "broker": {"endpoint": "tcp://ps:5555", "version": "9.9", "uptime_s": 3700},
        "pair": {
            "role": "primary",
            "state": "active",
            "term": 4,
            "failovers": 1,
            "peer": {"endpoint": "tcp://ps2:5555", "state": "passive", "term": 4, "alive": False},
        },
    }


def signature(markup: str) -> dict[str, list[str]]:
    """What a reader sees in the page's main part, independent of how the markup is
    serialised: pills, row and chart attributes, headings, cells' text."""
    m = re.search(r'<main id="main">(.*)</main>', markup, re.S)
    assert m, markup[:500]
    main = m.group(1)
    return {
        "pills": re.findall(r'<span class="pill ([^"]+)">([^<]*)</span>', main),
        "rows": re.findall(r'<tr (data-[a-z]+="[^"]*")>', main),
        "charts": re.findall(
            r'<svg class="chart (\w+)" data-series="\w+" data-points="(\d+)"', main
        ),
        "headings": re.findall(r"<h[23][^>]*>([^<]*)", main),
        # (not requests/s: the script has it from two polls, the server never)
        "cells": [
            html.unescape(c) for c in re.findall(r"<td(?![^>]*data-rate)[^>]*>([^<]*)</td>", main)
        ],
        "ticks": re.findall(r'<text class="tick"[^>]*text-anchor="end">([^<]*)</text>', main),
    }


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (apt-get install chromium)")
def test_script_draws_what_the_server_renders(tmp_path: Path) -> None:
    """The page's script (drawing from /status.json) and the server's rendering show the
    same things, for every kind of section."""
    import asyncio
    import threading

    from zps.ops.config import Metrics
    from zps.ops.metrics import MetricsServer
    from zps.ops.page import render

    report = synthetic_report(time.time())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = MetricsServer(Metrics(port=free_port()), lambda: [], status=lambda: report)
    heartbeat = asyncio.run_coroutine_threadsafe(server.loop_heartbeat(), loop)
    try:
        server.start()
        assert server.port is not None
        binary = _chromium()
        assert binary is not None
        out = _browse(
            binary,
            f"http://127.0.0.1:{server.port}/",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
        )
        assert "<html" in out.stdout, out.stderr[-2000:]
        dom = re.sub(r"<script>.*?</script>", "", out.stdout, flags=re.S)
        assert re.search(r'<body[^>]* data-drawn="[1-9]', dom), dom[:1000]
        drawn, rendered = signature(dom), signature(render(report))
        for key in rendered:
            assert drawn[key] == rendered[key], key
        sig = rendered
        assert ("lost", "lost") in sig["pills"] and ("degraded", "degraded") in sig["pills"]
        assert ("lost", "drained") in sig["pills"] and ("dead", "dead") in sig["pills"]
        assert ("loss", "29") in sig["charts"] and ("rows", "30") in sig["charts"]
        assert ("loss", "1") in sig["charts"]  # the orphan job's single point
        assert "1m 15s" in sig["cells"]  # epoch 2's ETA
        assert "Broker pair" in sig["headings"]
    finally:
        server.stop()
        heartbeat.cancel()
        asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


async def _cancel_tasks() -> None:
    import asyncio

    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
