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
