// The status page's script: polls /status.json and draws the sections again with
// the markup zps/ops/page.py renders (keep the two alike).  Shard load (requests/s)
// comes from the difference between two polls.
(function () {
  "use strict";
  var POLL_MS = 1000 * (parseFloat(document.body.dataset.poll) || 2);
  var W = 480, H = 180, ML = 58, MR = 14, MT = 26, MB = 30;
  var ORDER = ["lost", "unassigned", "degraded", "holding", "ok"];
  var lastRequests = {};  // shard -> [time ms, requests]
  var rates = {};         // shard -> requests/s

  function e(v) {
    return (v === null || v === undefined ? "" : String(v))
      .replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#x27;");
  }
  function pill(text, kind) {
    return '<span class="pill ' + e(kind || text) + '">' + e(text) + "</span>";
  }
  function num(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    var a = Math.abs(v);
    if (a >= 1e9) return +(v / 1e9).toPrecision(3) + "G";
    if (a >= 1e6) return +(v / 1e6).toPrecision(3) + "M";
    if (a >= 1e4) return +(v / 1e3).toPrecision(3) + "k";
    if (a >= 100 || v === Math.round(v)) return v.toFixed(0);
    return String(+v.toPrecision(3));
  }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    var units = ["B", "KiB", "MiB", "GiB"];
    for (var i = 0; i < units.length; i++) {
      if (Math.abs(n) < 1024 || i === units.length - 1)
        return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
      n /= 1024;
    }
  }
  function duration(s) {
    if (s === null || s === undefined) return "–";
    s = Math.round(s);
    function two(n) { return (n < 10 ? "0" : "") + n; }
    if (s >= 3600) return Math.floor(s / 3600) + "h " + two(Math.floor(s % 3600 / 60)) + "m";
    if (s >= 60) return Math.floor(s / 60) + "m " + two(s % 60) + "s";
    return s + "s";
  }
  function clock(t) {
    var d = new Date(t * 1000);
    function two(n) { return (n < 10 ? "0" : "") + n; }
    return two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds());
  }
  function ticks(lo, hi, n) {
    n = n || 4;
    if (!(hi > lo)) hi = lo + (Math.abs(lo) || 1);
    var raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), step = 10 * mag;
    var ms = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < ms.length; i++) if (ms[i] * mag >= raw * (1 - 1e-9)) { step = ms[i] * mag; break; }
    var start = Math.floor(lo / step + 1e-9) * step, count = Math.ceil((hi - start) / step - 1e-9), out = [];
    for (var k = 0; k <= count; k++) out.push(+(start + k * step).toPrecision(12));
    return out;
  }
  function chart(kind, title, ts, ys, zero) {
    var pts = [];
    for (var i = 0; i < ts.length && i < ys.length; i++)
      if (ys[i] !== null && isFinite(ys[i])) pts.push([ts[i], ys[i]]);
    var out = ['<svg class="chart ' + kind + '" data-series="' + kind + '" data-points="' + pts.length +
      '" width="' + W + '" height="' + H + '" viewBox="0 0 ' + W + " " + H + '" role="img" aria-label="' +
      e(title) + '">', '<text class="title" x="' + ML + '" y="16">' + e(title) + "</text>"];
    var x0 = ML, x1 = W - MR, y0 = H - MB, y1 = MT;
    function line(a, b, c, d, cls) {
      return '<line class="' + cls + '" x1="' + a + '" y1="' + b + '" x2="' + c + '" y2="' + d + '"/>';
    }
    if (!pts.length) {
      out.push(line(x0, y0, x1, y0, "axis"), line(x0, y0, x0, y1, "axis"));
      out.push('<text class="none" x="' + (x0 + x1) / 2 + '" y="' + (y0 + y1) / 2 +
        '" text-anchor="middle">no reports yet</text></svg>');
      return out.join("");
    }
    var loT = pts[0][0], hiT = pts[pts.length - 1][0];
    if (hiT <= loT) { loT -= 30; hiT += 30; }  // one point: in the middle of a minute
    var loY = zero ? 0 : Math.min.apply(null, pts.map(function (p) { return p[1]; }));
    var hiY = Math.max.apply(null, pts.map(function (p) { return p[1]; }));
    var yt = ticks(zero ? Math.min(loY, 0) : loY, hiY);
    loY = yt[0]; hiY = yt[yt.length - 1];
    function sx(t) { return Math.round((x0 + (t - loT) / (hiT - loT) * (x1 - x0)) * 10) / 10; }
    function sy(y) { return Math.round((y0 - (y - loY) / (hiY - loY) * (y0 - y1)) * 10) / 10; }
    yt.forEach(function (v) {
      var y = sy(v);
      out.push(line(x0, y, x1, y, "grid"));
      out.push('<text class="tick" x="' + (x0 - 6) + '" y="' + (y + 3.5) + '" text-anchor="end">' + num(v) + "</text>");
    });
    var shown = "";
    for (var j = 0; j < 4; j++) {
      var t = loT + (hiT - loT) * j / 3, x = sx(t);
      var anchor = j === 0 ? "start" : j === 3 ? "end" : "middle";
      out.push(line(x, y0, x, y0 + 4, "axis"));
      if (clock(t) !== shown) {  // a span of seconds: each time once
        shown = clock(t);
        out.push('<text class="tick" x="' + x + '" y="' + (y0 + 16) + '" text-anchor="' + anchor + '">' + shown + "</text>");
      }
    }
    out.push(line(x0, y0, x1, y0, "axis"), line(x0, y0, x0, y1, "axis"));
    var d = pts.map(function (p, i) { return (i === 0 ? "M" : "L") + sx(p[0]) + "," + sy(p[1]); }).join(" ");
    if (zero) out.push('<path class="area" d="' + d + " L" + sx(pts[pts.length - 1][0]) + "," + y0 +
      " L" + sx(pts[0][0]) + "," + y0 + ' Z"/>');
    out.push('<path class="line" d="' + d + '"/>');
    var last = pts[pts.length - 1];
    out.push('<circle class="dot" cx="' + sx(last[0]) + '" cy="' + sy(last[1]) + '" r="3"><title>' +
      num(last[1]) + "</title></circle></svg>");
    return out.join("");
  }
  function worst(r) {
    var states = {};
    (r.partitions || []).forEach(function (p) { states[p.state] = true; });
    for (var i = 0; i < ORDER.length; i++) if (states[ORDER[i]]) return ORDER[i];
    return "ok";
  }
  function header(r) {
    var b = r.broker || {};
    var parts = ["<b>" + e(b.endpoint) + "</b>", "zps <b>" + e(b.version) + "</b>",
      "up <b>" + duration(b.uptime_s) + "</b>", "map <b>v" + e(r.map_version) + "</b>",
      "<b>" + e(r.n_partitions) + "</b> partitions × <b>" + e(r.replication) + "</b> copies",
      "failovers <b>" + e(r.failovers) + "</b>"];
    return "<h1>zps</h1>" + pill(worst(r)) + '<span class="meta">' + parts.join(" · ") +
      '</span><span class="updated" id="updated">as of ' + clock(Date.now() / 1000) + "</span>";
  }
  function pair(r) {
    var p = r.pair;
    if (!p) return "";
    var peer = p.peer || {};
    return '<section id="pair"><h2>Broker pair</h2><dl class="kv"><dt>this broker</dt><dd>' +
      pill(String(p.role)) + " " + pill(String(p.state)) + " term " + e(p.term) +
      "</dd><dt>peer</dt><dd><code>" + e(peer.endpoint) + "</code> " + pill(String(peer.state)) + " " +
      pill(peer.alive ? "alive" : "dead") + " term " + e(peer.term) + "</dd><dt>takeovers</dt><dd>" +
      e(p.failovers) + "</dd></dl></section>";
  }
  function table(id, title, note, heads, rows, empty) {
    var th = heads.map(function (h) {
      return h.charAt(0) === "#" ? '<th class="num">' + e(h.slice(1)) + "</th>" : "<th>" + e(h) + "</th>";
    }).join("");
    var body = rows.join("") || '<tr><td colspan="' + heads.length + '" class="empty">' + e(empty) + "</td></tr>";
    return '<section id="' + id + '"><h2>' + e(title) + " <small>" + e(note) + "</small></h2><table><thead><tr>" +
      th + "</tr></thead><tbody>" + body + "</tbody></table></section>";
  }
  function partitions(r) {
    var rows = (r.partitions || []).map(function (p) {
      var reps = (p.replicas || []).map(function (x) {
        return '<span class="replica"><span class="node">' + e(x.node) + '</span> <span class="' +
          (x.lag ? "lag behind" : "lag") + '">' + (x.in_sync ? "in sync" : "catching up") + ", lag " +
          e(x.lag === null || x.lag === undefined ? "–" : x.lag) + "</span></span>";
      }).join("");
      return '<tr data-partition="' + e(p.partition) + '"><td class="num">' + e(p.partition) + "</td><td>" +
        pill(p.state) + '</td><td class="node">' + e(p.primary || "–") + "</td><td>" +
        (reps || '<span class=muted>none</span>') + '</td><td class="num">' + num(p.lsn) +
        '</td><td class="num">' + e(p.epoch) + '</td><td class="num">' + e(p.slots) + "</td></tr>";
    });
    return table("partitions", "Partitions", rows.length + " in all", ["#Partition", "State", "Primary",
      "Replicas (lag in updates)", "#LSN", "#Epoch", "#Slots"], rows, "none");
  }
  function shards(r) {
    var now = Date.now();
    var rows = (r.shards || []).map(function (s) {
      var st = s.stats || {}, prev = lastRequests[s.node];
      if (prev && st.requests !== undefined && now > prev[0])
        rates[s.node] = Math.max(0, (st.requests - prev[1]) * 1000 / (now - prev[0]));
      if (st.requests !== undefined) lastRequests[s.node] = [now, st.requests];
      return '<tr data-shard="' + e(s.node) + '"><td class="node">' + e(s.node) + "</td><td>" + e(s.host) +
        "</td><td>" + pill(s.role) + (s.drained ? " " + pill("drained", "lost") : "") +
        '</td><td class="num">' + e(s.partition === null || s.partition === undefined ? "–" : s.partition) +
        '</td><td class="num">' + num(s.lsn) + '</td><td class="num">' + num(st.requests) +
        '</td><td class="num" data-rate="' + e(s.node) + '">' + (s.node in rates ? num(rates[s.node]) : "–") +
        '</td><td class="num">' + bytes(st.nbytes) + '</td><td class="num">' + e(s.last_seen_s) + "s</td></tr>";
    });
    return table("shards", "Shards", rows.length + " registered", ["Shard", "Host", "Role", "#Partition",
      "#LSN", "#Requests", "#Req/s", "#Memory", "#Last heard"], rows, "no shard registered");
  }
  function epochs(job) {
    var rows = (job.epochs || []).map(function (ep) {
      var total = Math.max(1, ep.total), done = ep.done / total * 100, run = ep.running / total * 100;
      var state = ep.done >= ep.total ? "done" : ep.running || ep.done ? "running" : "";
      return '<tr data-epoch="' + e(ep.epoch) + '"><td class="num">' + e(ep.epoch) +
        '</td><td><div class="bar"><span style="width:' + done.toFixed(1) + '%"></span><span class="run" style="left:' +
        done.toFixed(1) + "%;width:" + run.toFixed(1) + '%"></span></div></td><td class="num">' + e(ep.done) +
        " / " + e(ep.total) + '</td><td class="num">' + e(ep.running) + "</td><td>" +
        (state ? pill(state) : '<span class=muted>waiting</span>') + '</td><td class="num">' +
        (state !== "done" ? duration(ep.eta_s) : "–") + "</td></tr>";
    });
    return '<table class="epochs"><thead><tr><th class="num">Epoch</th><th>Progress</th>' +
      '<th class="num">Tasks done</th><th class="num">Running</th><th>State</th>' +
      '<th class="num">ETA</th></tr></thead><tbody>' + rows.join("") + "</tbody></table>";
  }
  function jobs(r) {
    var tr = r.training || {}, history = tr.history || {}, list = tr.jobs || [], names = [], byName = {};
    list.forEach(function (j) { names.push(j.job); byName[j.job] = j; });
    Object.keys(history).forEach(function (n) { if (!(n in byName)) names.push(n); });
    var cards = names.map(function (name) {
      var job = byName[name], h = history[name] || { t: [], loss: [], rows_per_s: [] };
      var losses = h.loss.filter(function (v) { return v !== null; }), rates_ = h.rows_per_s, stats = [];
      if (job) {
        stats.push(e(job.done) + " / " + e(job.total) + " tasks");
        stats.push(e(job.records) + " records in tasks of " + e(job.per_task));
        if (job.retried) stats.push(e(job.retried) + " retried");
      }
      if (losses.length) stats.push("loss " + num(losses[losses.length - 1]));
      if (rates_.length) stats.push(num(rates_[rates_.length - 1]) + " rows/s");
      var state = job && job.failed ? "failed" : job && job.done >= job.total ? "done" : "running";
      return '<div class="job" data-job="' + e(name) + '"><h3>' + e(name) + " " + pill(state) +
        '<span class="stats">' + stats.join(" · ") + "</span></h3>" + (job ? epochs(job) : "") +
        '<div class="charts">' + chart("loss", "loss", h.t, h.loss, false) +
        chart("rows", "rows/s", h.t, rates_, true) + "</div></div>";
    });
    var note = tr.mode ? "mode " + tr.mode + ", committed step " + tr.committed_step : "";
    return '<section id="jobs"><h2>Jobs <small>' + e(note) + "</small></h2>" +
      (cards.join("") || '<div class="empty">no job yet (ps.create_job)</div>') + "</section>";
  }
  function clients(r) {
    var steps = (r.training || {}).workers || {};
    var rows = (r.clients || []).map(function (c) {
      return '<tr><td class="node">' + e(c.node) + "</td><td>" + e(c.name) + "</td><td>" + e(c.host) +
        '</td><td class="num">' + e(c.pid) + '</td><td class="num">' + e(c.node in steps ? steps[c.node] : "–") +
        '</td><td class="num">' + e(c.last_seen_s) + "s</td></tr>";
    });
    return table("clients", "Clients and workers", rows.length + " connected",
      ["Client", "Name", "Host", "#PID", "#Step", "#Last heard"], rows, "no client connected");
  }
  function draw(r) {
    document.getElementById("header").innerHTML = header(r);
    document.getElementById("main").innerHTML =
      [pair, partitions, shards, jobs, clients].map(function (f) { return f(r); }).join("");
    document.body.dataset.drawn = String((+document.body.dataset.drawn || 0) + 1);
  }
  function poll() {
    fetch("status.json", { cache: "no-store" })
      .then(function (resp) {
        if (!resp.ok) throw new Error("HTTP " + resp.status);
        return resp.json();
      })
      .then(draw)
      .catch(function (err) {
        var u = document.getElementById("updated");
        if (u) u.innerHTML = '<span class="error">' + e("cannot reach the broker: " + err.message) + "</span>";
      })
      .then(function () { setTimeout(poll, POLL_MS); });
  }
  poll();
})();
