"""The broker's status page: ``GET /`` on its HTTP port (see :mod:`zps.ops.metrics`).

:func:`render` turns a status report (``Broker.status``, as ``/status.json`` serves it
and ``zps-server status --json`` prints it) into one HTML page: the broker (and its
pair), the partitions (primary, replicas with their lag, state), the shards (host,
role, load), the jobs (progress and ETA per epoch, loss and rows/s plotted over
time) and the workers.  No framework: the markup is built here, the charts are
inline SVG, and the page's script (``page.js``, shipped beside this module with
``page.css``) polls ``/status.json`` every few seconds and draws the same sections
with the same markup, so the page stays live; without JavaScript it is the
report as it was when loaded.

Nothing here does I/O but reading the two static files, once.
"""

from __future__ import annotations

import functools
import html
import math
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

__all__ = ["POLL_S", "render", "ticks"]

#: How often the page's script asks for ``/status.json``, in seconds.
POLL_S = 2.0

#: The worst state first: the cluster's state is its worst partition's.
_STATE_ORDER = ("lost", "unassigned", "degraded", "holding", "ok")

_NONE = "\u2013"  # an en dash: no value
_TIMES = "\u00d7"

#: Chart geometry (page.js uses the same numbers).
_W, _H, _ML, _MR, _MT, _MB = 480, 180, 58, 14, 26, 30


@functools.cache
def _static(name: str) -> str:
    return resources.files("zps.ops").joinpath(name).read_text(encoding="utf-8")


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _pill(text: str, kind: str | None = None) -> str:
    return f'<span class="pill {_e(kind or text)}">{_e(text)}</span>'


def _bytes(n: float | None) -> str:
    if n is None:
        return _NONE
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _num(v: float | None) -> str:
    """A short number for tables and ticks: 1.23k, 4.5M, 0.0123."""
    if v is None or not math.isfinite(v):
        return _NONE
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:.3g}G"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.3g}"


def _duration(s: float | None) -> str:
    if s is None:
        return _NONE
    s = round(s)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]`` (steps of 1, 2, 2.5 or 5
    times a power of ten); the first is <= lo, the last >= hi."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    start = math.floor(lo / step + 1e-9) * step
    count = math.ceil((hi - start) / step - 1e-9)
    return [round(start + i * step, 12) for i in range(count + 1)]


def chart(
    kind: str, title: str, ts: Sequence[float], ys: Sequence[float | None], *, zero: bool
) -> str:
    """An SVG line chart of ``ys`` over the times ``ts`` (Unix seconds), with axes,
    grid and tick labels; ``zero``: the y axis starts at 0."""
    pts = [(t, y) for t, y in zip(ts, ys, strict=False) if y is not None and math.isfinite(y)]
    out = [
        f'<svg class="chart {kind}" data-series="{kind}" data-points="{len(pts)}" '
        f'width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="{_e(title)}">',
        f'<text class="title" x="{_ML}" y="16">{_e(title)}</text>',
    ]
    x0, x1, y0, y1 = _ML, _W - _MR, _H - _MB, _MT
    if not pts:
        out.append(f'<line class="axis" x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}"/>')
        out.append(f'<line class="axis" x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}"/>')
        mid = (y0 + y1) / 2
        out.append(f'<text class="none" x="{(x0 + x1) / 2}" y="{mid}" text-anchor="middle">')
        out.append("no reports yet</text></svg>")
        return "".join(out)
    lo_t, hi_t = pts[0][0], pts[-1][0]
    if hi_t <= lo_t:  # one point: in the middle of a minute
        lo_t, hi_t = lo_t - 30, hi_t + 30
    lo_y = 0.0 if zero else min(y for _, y in pts)
    hi_y = max(y for _, y in pts)
    yt = ticks(min(lo_y, 0.0) if zero else lo_y, hi_y)
    lo_y, hi_y = yt[0], yt[-1]

    def sx(t: float) -> float:
        return round(x0 + (t - lo_t) / (hi_t - lo_t) * (x1 - x0), 1)

    def sy(y: float) -> float:
        return round(y0 - (y - lo_y) / (hi_y - lo_y) * (y0 - y1), 1)

    for v in yt:
        y = sy(v)
        out.append(f'<line class="grid" x1="{x0}" y1="{y}" x2="{x1}" y2="{y}"/>')
        out.append(
            f'<text class="tick" x="{x0 - 6}" y="{y + 3.5}" text-anchor="end">{_num(v)}</text>'
        )
    shown = ""
    for i in range(4):
        t = lo_t + (hi_t - lo_t) * i / 3
        x = sx(t)
        anchor = "start" if i == 0 else "end" if i == 3 else "middle"
        out.append(f'<line class="axis" x1="{x}" y1="{y0}" x2="{x}" y2="{y0 + 4}"/>')
        if _clock(t) != shown:  # a span of seconds: each time once
            shown = _clock(t)
            out.append(
                f'<text class="tick" x="{x}" y="{y0 + 16}" text-anchor="{anchor}">{shown}</text>'
            )
    out.append(f'<line class="axis" x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}"/>')
    out.append(f'<line class="axis" x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}"/>')
    line = " ".join(f"{'M' if i == 0 else 'L'}{sx(t)},{sy(y)}" for i, (t, y) in enumerate(pts))
    if zero:
        area = f"{line} L{sx(pts[-1][0])},{y0} L{sx(pts[0][0])},{y0} Z"
        out.append(f'<path class="area" d="{area}"/>')
    out.append(f'<path class="line" d="{line}"/>')
    t, y = pts[-1]
    out.append(f'<circle class="dot" cx="{sx(t)}" cy="{sy(y)}" r="3"><title>{_num(y)}</title>')
    out.append("</circle></svg>")
    return "".join(out)


def _worst(report: dict[str, Any]) -> str:
    states = {p["state"] for p in report.get("partitions", [])}
    return next((s for s in _STATE_ORDER if s in states), "ok")


def _header(report: dict[str, Any]) -> str:
    b = report.get("broker", {})
    parts = [
        f"<b>{_e(b.get('endpoint'))}</b>",
        f"zps <b>{_e(b.get('version'))}</b>",
        f"up <b>{_duration(b.get('uptime_s'))}</b>",
        f"map <b>v{_e(report.get('map_version'))}</b>",
        f"<b>{_e(report.get('n_partitions'))}</b> partitions {_TIMES} "
        f"<b>{_e(report.get('replication'))}</b> copies",
        f"failovers <b>{_e(report.get('failovers'))}</b>",
    ]
    state = _worst(report)
    return (
        f'<h1>zps</h1>{_pill(state)}<span class="meta">{" · ".join(parts)}</span>'
        f'<span class="updated" id="updated">as of {_clock(time.time())}</span>'
    )


def _pair(report: dict[str, Any]) -> str:
    pair = report.get("pair")
    if not pair:
        return ""
    peer = pair.get("peer", {})
    alive = "alive" if peer.get("alive") else "dead"
    return (
        '<section id="pair"><h2>Broker pair</h2><dl class="kv">'
        f"<dt>this broker</dt><dd>{_pill(str(pair.get('role')))} "
        f"{_pill(str(pair.get('state')))} term {_e(pair.get('term'))}</dd>"
        f"<dt>peer</dt><dd><code>{_e(peer.get('endpoint'))}</code> "
        f"{_pill(str(peer.get('state')))} {_pill(alive)} term {_e(peer.get('term'))}</dd>"
        f"<dt>takeovers</dt><dd>{_e(pair.get('failovers'))}</dd></dl></section>"
    )


def _table(
    sid: str, title: str, note: str, heads: Sequence[str], rows: list[str], empty: str
) -> str:
    th = "".join(
        f'<th class="num">{_e(h[1:])}</th>' if h.startswith("#") else f"<th>{_e(h)}</th>"
        for h in heads
    )
    body = "".join(rows) or f'<tr><td colspan="{len(heads)}" class="empty">{_e(empty)}</td></tr>'
    return (
        f'<section id="{sid}"><h2>{_e(title)} <small>{_e(note)}</small></h2>'
        f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></section>"
    )


def _partitions(report: dict[str, Any]) -> str:
    rows = []
    for p in report.get("partitions", []):
        reps = []
        for r in p.get("replicas", []):
            lag = r.get("lag")
            cls = "lag behind" if lag else "lag"
            sync = "in sync" if r.get("in_sync") else "catching up"
            reps.append(
                f'<span class="replica"><span class="node">{_e(r["node"])}</span> '
                f'<span class="{cls}">{sync}, lag {_e(_NONE if lag is None else lag)}</span></span>'
            )
        rows.append(
            f'<tr data-partition="{_e(p["partition"])}"><td class="num">{_e(p["partition"])}</td>'
            f"<td>{_pill(p['state'])}</td>"
            f'<td class="node">{_e(p.get("primary") or _NONE)}</td>'
            f"<td>{''.join(reps) or '<span class=muted>none</span>'}</td>"
            f'<td class="num">{_num(p.get("lsn"))}</td><td class="num">{_e(p.get("epoch"))}</td>'
            f'<td class="num">{_e(p.get("slots"))}</td></tr>'
        )
    note = f"{len(rows)} in all"
    heads = ("#Partition", "State", "Primary", "Replicas (lag in updates)", "#LSN", "#Epoch")
    return _table("partitions", "Partitions", note, (*heads, "#Slots"), rows, "none")


def _shards(report: dict[str, Any]) -> str:
    rows = []
    for s in report.get("shards", []):
        st = s.get("stats") or {}
        part = s.get("partition")
        rows.append(
            f'<tr data-shard="{_e(s["node"])}"><td class="node">{_e(s["node"])}</td>'
            f"<td>{_e(s.get('host'))}</td><td>{_pill(s['role'])}"
            f"{' ' + _pill('drained', 'lost') if s.get('drained') else ''}</td>"
            f'<td class="num">{_e(_NONE if part is None else part)}</td>'
            f'<td class="num">{_num(s.get("lsn"))}</td>'
            f'<td class="num">{_num(st.get("requests"))}</td>'
            f'<td class="num" data-rate="{_e(s["node"])}">{_NONE}</td>'
            f'<td class="num">{_bytes(st.get("nbytes"))}</td>'
            f'<td class="num">{_e(s.get("last_seen_s"))}s</td></tr>'
        )
    heads = ("Shard", "Host", "Role", "#Partition", "#LSN", "#Requests", "#Req/s", "#Memory")
    note = f"{len(rows)} registered"
    return _table("shards", "Shards", note, (*heads, "#Last heard"), rows, "no shard registered")


def _epochs(job: dict[str, Any]) -> str:
    rows = []
    for e in job.get("epochs", []):
        total = max(1, e["total"])
        done, run = e["done"] / total * 100, e["running"] / total * 100
        state = (
            "done" if e["done"] >= e["total"] else "running" if e["running"] or e["done"] else ""
        )
        rows.append(
            f'<tr data-epoch="{_e(e["epoch"])}"><td class="num">{_e(e["epoch"])}</td>'
            f'<td><div class="bar"><span style="width:{done:.1f}%"></span>'
            f'<span class="run" style="left:{done:.1f}%;width:{run:.1f}%"></span></div></td>'
            f'<td class="num">{_e(e["done"])} / {_e(e["total"])}</td>'
            f'<td class="num">{_e(e["running"])}</td>'
            f"<td>{_pill(state) if state else '<span class=muted>waiting</span>'}</td>"
            f'<td class="num">{_duration(e.get("eta_s")) if state != "done" else _NONE}</td></tr>'
        )
    return (
        '<table class="epochs"><thead><tr><th class="num">Epoch</th><th>Progress</th>'
        '<th class="num">Tasks done</th><th class="num">Running</th><th>State</th>'
        f'<th class="num">ETA</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _jobs(report: dict[str, Any]) -> str:
    training = report.get("training") or {}
    history = training.get("history") or {}
    jobs = list(training.get("jobs") or [])
    # reports of a job this broker has no record of (e.g. created before a restart)
    known = {j["job"] for j in jobs}
    cards = []
    for name in [*(j["job"] for j in jobs), *(n for n in history if n not in known)]:
        job = next((j for j in jobs if j["job"] == name), None)
        h = history.get(name) or {"t": [], "loss": [], "rows_per_s": []}
        losses = [v for v in h["loss"] if v is not None]
        rates = h["rows_per_s"]
        stats = []
        if job is not None:
            stats.append(f"{_e(job['done'])} / {_e(job['total'])} tasks")
            stats.append(f"{_e(job['records'])} records in tasks of {_e(job['per_task'])}")
            if job.get("retried"):
                stats.append(f"{_e(job['retried'])} retried")
        if losses:
            stats.append(f"loss {_num(losses[-1])}")
        if rates:
            stats.append(f"{_num(rates[-1])} rows/s")
        state = (
            "failed"
            if job and job.get("failed")
            else "done"
            if job and job["done"] >= job["total"]
            else "running"
        )
        cards.append(
            f'<div class="job" data-job="{_e(name)}"><h3>{_e(name)} {_pill(state)}'
            f'<span class="stats">{" · ".join(stats)}</span></h3>'
            + (_epochs(job) if job is not None else "")
            + '<div class="charts">'
            + chart("loss", "loss", h["t"], h["loss"], zero=False)
            + chart("rows", "rows/s", h["t"], rates, zero=True)
            + "</div></div>"
        )
    mode = training.get("mode")
    note = f"mode {mode}, committed step {training.get('committed_step')}" if mode else ""
    body = "".join(cards) or '<div class="empty">no job yet (ps.create_job)</div>'
    return f'<section id="jobs"><h2>Jobs <small>{_e(note)}</small></h2>{body}</section>'


def _workers(report: dict[str, Any]) -> str:
    steps = (report.get("training") or {}).get("workers") or {}
    rows = [
        f'<tr><td class="node">{_e(c["node"])}</td><td>{_e(c.get("name"))}</td>'
        f'<td>{_e(c.get("host"))}</td><td class="num">{_e(c.get("pid"))}</td>'
        f'<td class="num">{_e(steps.get(c["node"], _NONE))}</td>'
        f'<td class="num">{_e(c.get("last_seen_s"))}s</td></tr>'
        for c in report.get("clients", [])
    ]
    heads = ("Client", "Name", "Host", "#PID", "#Step", "#Last heard")
    note = f"{len(rows)} connected"
    return _table("clients", "Clients and workers", note, heads, rows, "no client connected")


#: The sections, in page order (page.js draws the same).
_SECTIONS: tuple[Callable[[dict[str, Any]], str], ...] = (
    _pair,
    _partitions,
    _shards,
    _jobs,
    _workers,
)


def render(report: dict[str, Any]) -> str:
    """The whole page for ``report`` (a status report as ``/status.json`` serves it)."""
    main = "".join(f(report) for f in _SECTIONS)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>zps: {_e((report.get('broker') or {}).get('endpoint'))}</title>"
        f"<style>{_static('page.css')}</style></head>"
        f'<body data-poll="{POLL_S:g}"><header id="header">{_header(report)}</header>'
        f'<main id="main">{main}</main>'
        f"<script>{_static('page.js')}</script></body></html>"
    )
