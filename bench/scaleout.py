#!/usr/bin/env python3
"""zps on simulated hosts: aggregate throughput for 1, 2 and 4 shard hosts.

    python bench/scaleout.py [--rate 1gbit] [--delay-ms 0.2] [--hosts 1,2,4]

Every "host" is a network namespace with one veth link to a bridge (the switch, in
a namespace of its own), so nothing is added to the host's network.  Each link is
shaped by ``tc`` in both directions (the host's eth0 for what it sends, its switch
port for what it receives): ``--rate`` with a token bucket (``tbf``), plus
``--delay-ms`` of one-way delay with ``netem`` where the kernel has it.  The broker
runs in a namespace of its own, one shard per shard namespace (one partition each,
replication 1), and the client processes in a client namespace that stands for
many worker hosts (its link is not shaped unless ``--client-rate`` says so).

The broker's link is ``shaped`` (its host has the same link as every shard host) or
``fat`` (not shaped, as for a broker on a host with a much faster NIC), both by
default; ``colocated`` runs the broker on the first shard host instead, sharing its
link.  ``--routers`` adds routing brokers (``zps-server broker --follow``): ``1`` and
``2`` start that many, ``each`` one per shard host; ``--router-place shard`` (default)
runs router j on shard host j (round-robin when there are more routers than shard
hosts), ``own`` on hosts of their own with shaped links.  The map then names each
partition's router (the one on its primary's host) and the broker carries no data.
Workloads, per step:

- dense: ``pull_dense`` of a 16 MiB float32 tensor (SGD) then ``push_dense`` of a
  same-size gradient: 32 MiB of values;
- sparse: ``pull_rows`` of 4096 unique Zipf ids of a 1,000,000 x 32 float32
  table (Adagrad), then ``push_rows`` of their gradients (acknowledged in the
  background while the next step pulls): 4096 rows (a row pulled and pushed in
  one step counts once) and 1 MiB of values.

GB/s counts values pulled plus values pushed (1 GB = 1e9 bytes; ids, headers and
TCP not counted).  Broker CPU and the machine's busy cores come from /proc; link
utilisation is the busier direction of a link's bytes (everything on the wire)
against its rate.

Needs root, ``ip netns`` and ``tc``; exits 2 with the reason otherwise.  Every
namespace and process it starts is removed on the way out (Ctrl-C and SIGTERM
included; processes also get SIGTERM if this script dies), and namespaces left by
a run that was SIGKILLed are removed by the next run.  Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

MiB = 1 << 20
DENSE_ELEMS = 4 * MiB  # 16 MiB of float32
SPARSE_ROWS = 1_000_000
SPARSE_DIM = 32
SPARSE_BATCH = 4096
ZIPF_A = 1.2
PORT = 5555
PREFIX = "zpsso"
HEARTBEAT_S = 0.2


# ---------------------------------------------------------------------------
# the client child (runs in the client namespace)


def _emit(tag: str, payload: Any = None) -> None:
    sys.stdout.write(tag + ("" if payload is None else " " + json.dumps(payload)) + "\n")
    sys.stdout.flush()


def zipf_ids(rng: np.random.Generator, n: int = SPARSE_BATCH) -> np.ndarray:
    """``n`` unique ids: Zipf(a=1.2) draws mod 1e6, first occurrences, topped up to ``n``."""
    draws = np.empty(0, dtype=np.int64)
    while True:
        draws = np.concatenate([draws, rng.zipf(ZIPF_A, 4 * n).astype(np.int64) % SPARSE_ROWS])
        uniq, first = np.unique(draws, return_index=True)
        if uniq.size >= n:
            return uniq[np.argsort(first)][:n].copy()


async def client_main(args: dict[str, Any]) -> None:
    import zps
    from zps.ops.config import ClientConfig

    rng = np.random.default_rng(args["seed"])
    loop = asyncio.get_running_loop()
    config = ClientConfig(timeout=20, connect_timeout=30, name=f"scaleout-{args['seed']}")
    async with zps.connect(args["address"], config) as ps:
        deadline = time.monotonic() + 60
        while True:  # every partition served before anything is created
            st = await ps.status()
            parts = st["partitions"]
            routed = {p for r in st.get("routers", []) for p in r["partitions"]}
            if (
                len(parts) == args["partitions"]
                and all(p["state"] == "ok" for p in parts)
                and len(st.get("routers", [])) == args["routers"]
                and (not args["routers"] or len(routed) == len(parts))
            ):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the cluster did not come up: {parts}")
            await asyncio.sleep(0.1)
        await ps.create_dense(
            "dense",
            shape=(DENSE_ELEMS,),
            dtype="float32",
            init=zps.init.Zeros(),
            optimizer=zps.optim.SGD(lr=0.01),
        )
        await ps.create_embedding(
            "sparse",
            dim=SPARSE_DIM,
            init=zps.init.Uniform(-0.01, 0.01),
            optimizer=zps.optim.Adagrad(lr=0.05),
        )
        steps = {
            "dense": DenseSteps(ps, rng, args["inflight"]),
            "sparse": SparseSteps(ps, rng),
        }
        for kind in args["workloads"]:
            work = steps[kind]
            await work.warm_up()
            _emit("READY")
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if line.strip() != "GO":
                raise SystemExit(0)
            requests, retries = ps.stats.requests, ps.stats.retries
            broker = (await ps.status())["broker"]
            overloaded, routed = broker["overloaded"], broker["routed"]
            stop = time.monotonic() + args["duration"]
            # Per task: when it started and when each step ended (CLOCK_MONOTONIC: the
            # parent reads the same clock).
            times: list[list[float]] = [[] for _ in range(args["inflight"])]
            await asyncio.gather(*(work.run(i, stop, times[i]) for i in range(args["inflight"])))
            with contextlib.suppress(zps.errors.ZpsError):
                await ps.flush()  # background pushes are answered before the next run
            result = {
                "kind": kind,
                "times": [[round(t, 5) for t in task] for task in times],
                "requests": ps.stats.requests - requests,
                "retries": ps.stats.retries - retries,
                "errors": work.errors,
            }
            # every client reads the broker's counts over about the same time
            after = (await ps.status())["broker"]
            result["overloaded"] = after["overloaded"] - overloaded
            result["broker_routed"] = after["routed"] - routed
            work.errors = []
            _emit("RESULT", result)


class Steps:
    #: What the calls raised (a step that fails is not counted; the task goes on).
    errors: list[str]

    async def step(self, i: int) -> None:
        raise NotImplementedError

    async def warm_up(self) -> None:
        raise NotImplementedError

    async def run(self, i: int, stop: float, times: list[float]) -> None:
        """Steps until ``stop``; ``times`` gets the start, then each step's end."""
        from zps.errors import ZpsError

        times.append(time.monotonic())
        while time.monotonic() < stop:
            try:
                await self.step(i)
            except ZpsError as e:
                self.errors.append(repr(e)[:200])
                times[-1] = time.monotonic()  # the failed step's time counts for nothing
                continue
            times.append(time.monotonic())


class DenseSteps(Steps):
    """Pull the 16 MiB tensor into a buffer of this task, push a same-size gradient."""

    def __init__(self, ps: Any, rng: np.random.Generator, inflight: int) -> None:
        self.ps, self.errors = ps, []
        self.grad = rng.standard_normal(DENSE_ELEMS, dtype=np.float32) * np.float32(1e-3)
        self.bufs = [np.empty(DENSE_ELEMS, np.float32) for _ in range(inflight)]

    async def step(self, i: int) -> None:
        await self.ps.pull_dense("dense", out=self.bufs[i])
        await self.ps.push_dense("dense", self.grad)

    async def warm_up(self) -> None:
        await self.step(0)


class SparseSteps(Steps):
    """Pull 4096 unique Zipf ids, push their gradients acknowledged in the background."""

    def __init__(self, ps: Any, rng: np.random.Generator) -> None:
        self.ps, self.errors = ps, []
        self.pool = [zipf_ids(rng) for _ in range(32)]
        self.grad = rng.standard_normal((SPARSE_BATCH, SPARSE_DIM), dtype=np.float32)
        self.grad *= np.float32(1e-2)
        self.n = 0

    async def step(self, i: int) -> None:
        ids = self.pool[self.n % len(self.pool)]
        self.n += 1
        await self.ps.pull_rows("sparse", ids)
        await self.ps.push_rows("sparse", ids, self.grad, wait=False)

    async def warm_up(self) -> None:
        for _ in self.pool:  # every row of the pool exists before the run
            await self.step(0)
        await self.ps.flush()


def child_main(args: dict[str, Any]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from zps.ops import malloc

    malloc.tune()
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(client_main(args))


# ---------------------------------------------------------------------------
# the lab: namespaces, links, processes


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20
    )
    if check and res.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} (in {ns}): {res.stderr.strip()}")
    return res


def parse_rate(text: str) -> int | None:
    """``1gbit``, ``200mbit``, ``500kbit``, ``none`` -> bits per second (None: unshaped)."""
    if text.lower() in ("none", "0", ""):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"a rate like 1gbit or 200mbit, not {text!r}")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return int(bits * 8 if m.group(3) == "bps" else bits)


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when this script dies (kept across exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def cpu_seconds(pid: int) -> float:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = data.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    buf: bytes = b""

    def line(self, timeout: float) -> str:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer within {timeout:g}s\n{self.tail()}")
            ready, _, _ = select.select([self.popen.stdout], [], [], left)
            if ready:
                chunk = os.read(self.popen.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"{self.name} exited early:\n{self.tail()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def expect(self, tag: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            line = self.line(max(0.0, deadline - time.monotonic()))
            if line.split(" ", 1)[0] == tag:
                rest = line[len(tag) :].strip()
                return json.loads(rest) if rest else None

    def send(self, text: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(text.encode() + b"\n")
        self.popen.stdin.flush()

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-2000:]
        return ""


@dataclass
class Lab:
    """Namespaces ``zpsso-PID-*``, a bridge in ``...-sw``, one private 10.x.y.0/24."""

    workdir: Path
    tag: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}")
    net: str = field(
        default_factory=lambda: f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
    )
    namespaces: list[str] = field(default_factory=list)
    hosts: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    netem: bool = False

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    @property
    def switch(self) -> str:
        return self.ns("sw")

    def add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def setup_switch(self) -> None:
        self.add_ns(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        # Which qdiscs the kernel has: tbf for the rate; netem (optional) for the delay.
        tc(self.switch, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit", "burst",
           "64kb", "latency", "10ms")  # fmt: skip
        tc(self.switch, "qdisc", "del", "dev", "lo", "root")
        probe = tc(self.switch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False)  # fmt: skip
        self.netem = probe.returncode == 0
        if self.netem:
            tc(self.switch, "qdisc", "del", "dev", "lo", "root")

    def node(self, name: str, octet: int) -> str:
        ns = self.ns(name)
        self.add_ns(ns)
        port = f"v{name}"[:15]
        ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
           "netns", ns)  # fmt: skip
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        addr = f"{self.net}.{octet}"
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        self.hosts[name] = addr
        return addr

    def shape(self, name: str, rate: int | None, delay_ms: float, queue_ms: float = 20) -> None:
        """Both directions of ``name``'s link: its eth0 (sending) and its switch port."""
        delay = delay_ms if self.netem else 0.0
        for ns, dev in ((self.ns(name), "eth0"), (self.switch, f"v{name}"[:15])):
            tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate is None and delay <= 0:
                continue
            if delay > 0:
                # netem: delay, and the rate with a queue long enough for it.
                args = ["netem", "delay", f"{delay}ms", "limit", "100000"]
                if rate is not None:
                    args += ["rate", f"{rate}bit"]
            else:
                assert rate is not None
                # A bucket of 1 ms of traffic (at least 64 KiB, a GSO packet) and
                # queue_ms of queue before drops.
                burst = max(64 << 10, rate // 8 // 1000)
                args = [
                    "tbf",
                    "rate",
                    f"{rate}bit",
                    "burst",
                    str(burst),
                    "latency",
                    f"{queue_ms}ms",
                ]
            tc(ns, "qdisc", "add", "dev", dev, "root", *args)

    def tcp_segments(self, name: str) -> tuple[int, int]:
        """(sent, retransmitted) TCP segments of ``name``'s namespace."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.ns(name), "cat", "/proc/net/snmp"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        head, values = [line.split()[1:] for line in out.splitlines() if line.startswith("Tcp:")]
        tcp = dict(zip(head, values, strict=True))
        return int(tcp["OutSegs"]), int(tcp["RetransSegs"])

    def link_bytes(self, name: str) -> tuple[int, int]:
        """(sent, received) bytes of ``name``'s eth0."""
        out = ip("-n", self.ns(name), "-s", "-j", "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def spawn(self, name: str, node: str, argv: list[str], *, pipes: bool = False) -> Proc:
        log = self.workdir / f"{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Simulated hosts share this machine's memory, real ones would not: no same-host
        # shared-memory payloads (zps.shm), every byte crosses the links.
        env["ZPS_NO_SHM"] = "1"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(node), *argv],  # execs: the pid is argv's
                stdout=subprocess.PIPE if pipes else out,
                stderr=out,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                env=env,
                cwd=self.workdir,
                preexec_fn=_die_with_parent,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[Proc]) -> None:
        for p in procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(5)
            for pipe in (p.popen.stdin, p.popen.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            if p in self.procs:
                self.procs.remove(p)

    def cleanup(self) -> None:
        self.stop(list(self.procs))
        # Deleting a namespace destroys its end of each veth pair, and with it the pair.
        for ns in reversed(self.namespaces):
            ip("netns", "del", ns, check=False)
        self.namespaces.clear()


def remove_stale() -> list[str]:
    """Namespaces of earlier runs whose script is gone (it was SIGKILLed)."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\w+", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------
# one measurement


@dataclass
class Row:
    hosts: int
    broker_link: str
    workload: str
    gbps: float
    mrows: float | None
    broker_cores: float
    busy_cores: float
    shard_cores: float
    own_cores: float
    broker_util: float | None
    shard_util: float | None
    client_gbit: float
    retrans: float
    #: Requests the clients sent again (a refusal such as OVERLOADED, or a timeout).
    resent: float
    #: Requests the broker refused OVERLOADED (its queue for a shard was full).
    overloaded: int
    #: Calls that failed (each failed step is left out of the rate).
    errors: int
    #: Requests the broker itself routed during the run (0 when routers carry them).
    broker_routed: int = 0
    routers: str = "0"
    router_cores: float = 0.0
    #: Routers on hosts of their own: the busiest router link's use.
    router_util: float | None = None
    ratio: float | None = None


@dataclass
class Sample:
    """Counters at one moment: links, TCP segments, CPU of each process and of the machine."""

    at: float
    links: dict[str, tuple[int, int]]
    tcp: dict[str, tuple[int, int]]
    cpu: dict[str, float]
    busy: float

    @staticmethod
    def take(lab: Lab, nodes: list[str], procs: list[Proc]) -> Sample:
        return Sample(
            at=time.monotonic(),
            links={n: lab.link_bytes(n) for n in nodes},
            tcp={n: lab.tcp_segments(n) for n in nodes},
            cpu={p.name: cpu_seconds(p.popen.pid) for p in procs},
            busy=machine_busy_seconds(),
        )

    def link_use(self, before: Sample, node: str, rate: int | None) -> float | None:
        """The busier direction of ``node``'s link against ``rate`` (None: not shaped)."""
        if rate is None:
            return None
        return self.link_bits(before, node) / rate

    def link_bits(self, before: Sample, node: str) -> float:
        """Bits per second in the busier direction of ``node``'s link."""
        dt = self.at - before.at
        sent, received = (self.links[node][k] - before.links[node][k] for k in (0, 1))
        return max(sent, received) * 8 / dt


def start_cluster(
    lab: Lab, n_hosts: int, tag: str, address: str, liveness: int, broker_node: str
) -> tuple[Proc, list[Proc]]:
    hb = ["--heartbeat-interval", str(HEARTBEAT_S), "--liveness", str(liveness)]
    broker = lab.spawn(
        f"broker-{tag}",
        broker_node,
        [sys.executable, "-m", "zps", "broker", "--bind", address, "--partitions",
         str(n_hosts), "--replication", "1", "--startup-grace", "0", *hb],
    )  # fmt: skip
    shards = []
    for i in range(n_hosts):
        host = lab.hosts[f"s{i}"]
        argv = [sys.executable, "-m", "zps", "shard", "--broker", address, "--advertise-host",
                host, "--replication-bind", f"tcp://{host}:0", "--host", f"s{i}", *hb]  # fmt: skip
        shards.append(lab.spawn(f"shard{i}-{tag}", f"s{i}", argv))
    return broker, shards


def start_routers(
    lab: Lab, n_routers: int, n_hosts: int, place: str, tag: str, address: str, liveness: int
) -> tuple[list[Proc], list[str]]:
    """Routing brokers following ``address``: on the shard hosts, or on hosts of their own."""
    hb = ["--heartbeat-interval", str(HEARTBEAT_S), "--liveness", str(liveness)]
    routers, nodes = [], []
    for j in range(n_routers):
        node = f"s{j % n_hosts}" if place == "shard" else f"r{j}"
        bind = f"tcp://{lab.hosts[node]}:{PORT + 1 + j}"
        argv = [sys.executable, "-m", "zps", "broker", "--follow", address, "--bind", bind,
                "--host", node, *hb]  # fmt: skip
        routers.append(lab.spawn(f"router{j}-{tag}", node, argv))
        nodes.append(node)
    return routers, nodes


def measure(
    lab: Lab, opts: argparse.Namespace, n_hosts: int, broker_link: str, routers: str = "0"
) -> list[Row]:
    """Start a broker, ``n_hosts`` shards and the routers, run every workload, stop them."""
    rate = opts.rate if broker_link == "shaped" else None
    lab.shape("broker", rate, opts.delay_ms, opts.queue_ms)
    # colocated: the broker runs on the first shard host and shares its link.
    broker_node = "s0" if broker_link == "colocated" else "broker"
    address = f"tcp://{lab.hosts[broker_node]}:{PORT}"
    n_routers = n_hosts if routers == "each" else int(routers)
    tag = f"{n_hosts}-{broker_link}-r{routers}"
    started: list[Proc] = []
    try:
        broker, shards = start_cluster(lab, n_hosts, tag, address, opts.liveness, broker_node)
        router_procs, router_nodes = start_routers(
            lab, n_routers, n_hosts, opts.router_place, tag, address, opts.liveness
        )
        started += [broker, *shards, *router_procs]
        clients = []
        for n in range(opts.clients):
            args = {
                "address": address,
                "partitions": n_hosts,
                "routers": n_routers,
                "workloads": opts.workloads,
                "duration": opts.duration,
                "inflight": opts.inflight,
                "seed": n,
            }
            argv = [sys.executable, __file__, "--child", json.dumps(args)]
            clients.append(lab.spawn(f"client{n}-{tag}", "client", argv, pipes=True))
        started += clients
        own = [n for n in dict.fromkeys(router_nodes) if n.startswith("r")]
        nodes = ["broker", *(f"s{i}" for i in range(max(n_hosts, 1))), *own, "client"]
        rows = []
        for kind in opts.workloads:
            for c in clients:
                c.expect("READY", 120)
            # Counters are read over the middle of the run (its steady state), from
            # 20% to 90% of --duration after GO; a step counts if it completed in it.
            t0 = time.monotonic()
            for c in clients:
                c.send("GO")
            time.sleep(max(0.0, t0 + 0.2 * opts.duration - time.monotonic()))
            first = Sample.take(lab, nodes, started)
            time.sleep(max(0.0, t0 + 0.9 * opts.duration - time.monotonic()))
            last = Sample.take(lab, nodes, started)
            results = [c.expect("RESULT", opts.duration + 120) for c in clients]
            for err in {e for r in results for e in r["errors"]}:
                print(f"  ({n_hosts} hosts, {kind}) a call failed: {err}", file=sys.stderr)
            row = make_row(opts, first, last, results, kind, n_hosts, broker_link, broker, shards)
            row.routers = routers
            row.router_cores = sum(
                (last.cpu[p.name] - first.cpu[p.name]) / (last.at - first.at) for p in router_procs
            )
            row.router_util = (
                max(last.link_use(first, n, opts.rate) or 0.0 for n in own) if own else None
            )
            rows.append(row)
            print(fmt_row(rows[-1], os.cpu_count() or 1), flush=True)
        return rows
    finally:
        lab.stop(started)


def steps_within(times: list[float], w0: float, w1: float) -> float:
    """Steps of one task done within [w0, w1]: a step running across an edge counts
    for the part of it inside (as if it progressed evenly), so steps that take long
    against the window are not rounded away."""
    total = 0.0
    for start, end in itertools.pairwise(times):
        if end > start:
            total += max(0.0, min(end, w1) - max(start, w0)) / (end - start)
    return total


def make_row(
    opts: argparse.Namespace,
    first: Sample,
    last: Sample,
    results: list[dict[str, Any]],
    kind: str,
    n_hosts: int,
    broker_link: str,
    broker: Proc,
    shards: list[Proc],
) -> Row:
    dt = last.at - first.at
    steps = sum(steps_within(task, first.at, last.at) for r in results for task in r["times"]) / dt
    step_bytes = 2 * DENSE_ELEMS * 4 if kind == "dense" else 2 * SPARSE_BATCH * SPARSE_DIM * 4
    cores = {name: (last.cpu[name] - first.cpu[name]) / dt for name in first.cpu}
    segs = sum(last.tcp[n][0] - first.tcp[n][0] for n in first.tcp)
    retrans = sum(last.tcp[n][1] - first.tcp[n][1] for n in first.tcp)
    shard_use = [last.link_use(first, f"s{i}", opts.rate) for i in range(n_hosts)]
    return Row(
        hosts=n_hosts,
        broker_link=broker_link,
        workload=kind,
        gbps=steps * step_bytes / 1e9,
        mrows=steps * SPARSE_BATCH / 1e6 if kind == "sparse" else None,
        broker_cores=cores[broker.name],
        busy_cores=(last.busy - first.busy) / dt,
        shard_cores=max(cores[s.name] for s in shards),
        own_cores=sum(cores.values()),
        broker_util=last.link_use(first, "broker", opts.rate if broker_link == "shaped" else None),
        shard_util=None if opts.rate is None else sum(u or 0.0 for u in shard_use) / n_hosts,
        client_gbit=last.link_bits(first, "client") / 1e9,
        retrans=retrans / max(segs, 1),
        resent=sum(r["retries"] for r in results) / max(1, sum(r["requests"] for r in results)),
        overloaded=max(r["overloaded"] for r in results),
        errors=sum(len(r["errors"]) for r in results),
        broker_routed=max(r.get("broker_routed", 0) for r in results),
    )


COLUMNS = [
    "shard hosts", "broker link", "routers", "workload", "GB/s", "M rows/s", "x 1 host",
    "broker CPU (cores)", "router CPU (cores)", "broker routed", "router link use",
    "zps CPU (cores)", "busy cores (machine)", "hottest shard CPU",
    "broker link use", "shard link use (mean)", "client link Gbit/s", "TCP retransmitted",
    "requests re-sent", "OVERLOADED", "caller errors",
]  # fmt: skip
HEADER = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)


def fmt_row(r: Row, ncpu: int) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    cells = [
        str(r.hosts),
        r.broker_link,
        r.routers,
        r.workload,
        f"{r.gbps:.3f}",
        "-" if r.mrows is None else f"{r.mrows:.3f}",
        "-" if r.ratio is None else f"{r.ratio:.2f}x",
        f"{r.broker_cores:.2f} ({100 * r.broker_cores / max(r.busy_cores, 1e-9):.0f}% of busy)",
        f"{r.router_cores:.2f}",
        str(r.broker_routed),
        pct(r.router_util),
        f"{r.own_cores:.2f}",
        f"{r.busy_cores:.2f} of {ncpu}",
        f"{r.shard_cores:.2f}",
        pct(r.broker_util),
        pct(r.shard_util),
        f"{r.client_gbit:.2f}",
        f"{100 * r.retrans:.1f}%",
        f"{100 * r.resent:.1f}%",
        str(r.overloaded),
        str(r.errors),
    ]
    return "| " + " | ".join(cells) + " |"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    add = ap.add_argument
    add(
        "--rate",
        type=parse_rate,
        default=parse_rate("1gbit"),
        help="every shaped link's rate, each direction (default 1gbit; none)",
    )
    add(
        "--client-rate",
        type=parse_rate,
        default=None,
        help="the client namespace's link (default: not shaped)",
    )
    add(
        "--delay-ms",
        type=float,
        default=0.2,
        help="one-way delay per link direction; needs sch_netem (default 0.2)",
    )
    add(
        "--queue-ms",
        type=float,
        default=20,
        help="tbf: traffic a link queues before it drops, in ms (default 20)",
    )
    add("--hosts", default="1,2,4", help="shard host counts (default 1,2,4)")
    add(
        "--broker-link",
        default="shaped,fat",
        help="shaped (like every host), fat (not shaped), colocated (the broker on the first "
        "shard host, sharing its link); default shaped,fat",
    )
    add(
        "--routers",
        default="0",
        help="routing brokers per cluster, comma-separated runs: 0 (the broker routes), 1, 2, "
        "each (one per shard host); default 0",
    )
    add(
        "--router-place",
        default="shard",
        choices=("shard", "own"),
        help="routers on the shard hosts (router j on host j) or on hosts of their own "
        "(default shard)",
    )
    add("--workloads", default="dense,sparse", help="dense and/or sparse (default both)")
    add("--duration", type=float, default=8.0, help="seconds per measurement (default 8)")
    add(
        "--liveness",
        type=int,
        default=10,
        help=f"silent heartbeats ({HEARTBEAT_S:g} s) before a peer is dead; a primary's "
        "lease is liveness - 1 heartbeats (default 10)",
    )
    add("--clients", type=int, default=2, help="client processes (default 2)")
    add("--inflight", type=int, default=2, help="steps in flight per client (default 2)")
    add("--json", type=Path, help="also write every row as JSON")
    add("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    opts = ap.parse_args(argv)
    if opts.child:
        return opts
    opts.workloads = [w for w in opts.workloads.split(",") if w]
    if not opts.workloads or not set(opts.workloads) <= {"dense", "sparse"}:
        ap.error("--workloads: dense and/or sparse")
    opts.hosts = [int(x) for x in opts.hosts.split(",")]
    opts.broker_link = [x for x in opts.broker_link.split(",") if x]
    opts.routers = [x for x in opts.routers.split(",") if x]
    if not opts.routers or not all(x == "each" or x.isdigit() for x in opts.routers):
        ap.error("--routers: counts (0, 1, 2, ...) and/or each")
    if not opts.broker_link or not set(opts.broker_link) <= {"shaped", "fat", "colocated"}:
        ap.error("--broker-link: shaped, fat and/or colocated")
    return opts


def rate_text(rate: int | None) -> str:
    return "not shaped" if rate is None else f"{rate / 1e9:g} Gbit/s"


def run(lab: Lab, opts: argparse.Namespace) -> list[Row]:
    try:
        lab.setup_switch()
    except RuntimeError as e:
        raise SystemExit(f"scaleout: cannot create network namespaces / a bridge: {e}") from None
    lab.node("broker", 1)
    for i in range(max(opts.hosts)):
        lab.node(f"s{i}", 11 + i)
        lab.shape(f"s{i}", opts.rate, opts.delay_ms, opts.queue_ms)
    if opts.router_place == "own":
        for j in range(max(max(opts.hosts) if r == "each" else int(r) for r in opts.routers)):
            lab.node(f"r{j}", 21 + j)
            lab.shape(f"r{j}", opts.rate, opts.delay_ms, opts.queue_ms)
    lab.node("client", 31)
    lab.shape("client", opts.client_rate, opts.delay_ms, opts.queue_ms)
    delay = f"{opts.delay_ms:g} ms" if lab.netem else "none (this kernel has no sch_netem)"
    print(
        f"links: {rate_text(opts.rate)} each direction, delay {delay}; client link "
        f"{rate_text(opts.client_rate)}; {opts.clients} clients x {opts.inflight} steps in "
        f"flight; {opts.duration:g} s per row; heartbeat {HEARTBEAT_S:g} s x liveness "
        f"{opts.liveness}; {os.cpu_count()} cores",
        flush=True,
    )
    print(HEADER, flush=True)
    rows: list[Row] = []
    for broker_link in opts.broker_link:
        for routers in opts.routers:
            for n in opts.hosts:
                rows += measure(lab, opts, n, broker_link, routers)
    return rows


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.child:
        child_main(json.loads(opts.child))
        return 0
    if os.geteuid() != 0:
        print("scaleout: network namespaces need root", file=sys.stderr)
        return 2
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"scaleout: no `{tool}` command (iproute2)", file=sys.stderr)
            return 2

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if opts.workdir:
            opts.workdir.mkdir(parents=True, exist_ok=True)
            workdir = opts.workdir
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zps-scaleout-")))
        for name in remove_stale():
            print(f"removed the namespace {name} of an earlier run", file=sys.stderr)
        lab = Lab(workdir)
        try:
            rows = run(lab, opts)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        finally:
            lab.cleanup()
            listed = ip("netns", "list", check=False).stdout.split()
            left = [n for n in listed if n.startswith(lab.tag + "-")]
            if left:
                print(f"scaleout: namespaces left behind: {left}", file=sys.stderr)
    base = {
        (r.broker_link, r.routers, r.workload): r.gbps for r in rows if r.hosts == min(opts.hosts)
    }
    for r in rows:
        b = base.get((r.broker_link, r.routers, r.workload))
        r.ratio = r.gbps / b if b else None
    print(f"\nall rows, ratios to {min(opts.hosts)} shard host(s); "
          f"{time.monotonic() - t_start:.0f} s in all")  # fmt: skip
    print(HEADER)
    for r in rows:
        print(fmt_row(r, os.cpu_count() or 1))
    if opts.json:
        out = {
            "rate": opts.rate,
            "client_rate": opts.client_rate,
            "delay_ms": opts.delay_ms if lab.netem else 0.0,
            "netem": lab.netem,
            "rows": [r.__dict__ for r in rows],
        }
        opts.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
