"""A cluster spread over network namespaces on this machine: broker, shards, worker
and a client each in a namespace of its own, joined by veth pairs to a bridge that
lives in one more namespace, so nothing is added to the host's network.

Every process binds and advertises its namespace's address (a private 10.x/24 that
exists only inside these namespaces).  A primary is SIGKILLed across namespaces: its
replica in another namespace takes over while a worker keeps pushing, and a
replacement shard re-syncs over the bridge.  Needs root and `ip netns`; skipped
otherwise.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from zps.testing import LocalCluster

# 1 s to declare a silent peer dead (a SIGKILLed one is noticed sooner: zmq drops its route)
HB = ["--heartbeat-interval", "0.1", "--liveness", "10"]
PORT = 5555  # each namespace has its own port space


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


@dataclass
class Lab:
    """Namespaces named zpsns-TAG-*, a bridge in zpsns-TAG-sw, one 10.x.y.0/24."""

    tag: str
    net: str  # "10.x.y"
    workdir: Path
    namespaces: list[str] = field(default_factory=list)
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)
    hosts: dict[str, str] = field(default_factory=dict)  # node name -> its address

    @property
    def switch(self) -> str:
        return f"zpsns-{self.tag}-sw"

    def add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def setup_switch(self) -> None:
        self.add_ns(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def node(self, name: str, octet: int) -> str:
        """A namespace with eth0 = 10.x.y.OCTET/24 on the bridge; returns the address."""
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

    def ns(self, name: str) -> str:
        return f"zpsns-{self.tag}-{name}"

    def run(
        self, name: str, node: str, args: list[str], *, pipes: bool = False
    ) -> subprocess.Popen[bytes]:
        """``ip netns exec`` a command (it execs: the pid is the command's own)."""
        log = self.workdir / f"{name}.log"
        # Simulated hosts share this machine's memory, real ones would not: no same-host
        # shared-memory payloads (zps.shm), every byte crosses the links.
        env = {**LocalCluster().env(), "ZPS_NO_SHM": "1"}
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(node), *args],
                stdout=subprocess.PIPE if pipes else out,
                stderr=out,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                env=env,
                cwd=self.workdir,
            )
        self.procs.append((name, popen, log))
        return popen

    def zps(self, name: str, node: str, *args: str) -> subprocess.Popen[bytes]:
        return self.run(name, node, [sys.executable, "-m", "zps", *args, *HB])

    def shard(self, name: str, node: str) -> subprocess.Popen[bytes]:
        host = self.hosts[node]
        return self.zps(
            name,
            node,
            "shard",
            "--broker",
            self.broker_address,
            "--advertise-host",
            host,
            "--replication-bind",
            f"tcp://{host}:0",
        )

    @property
    def broker_address(self) -> str:
        return f"tcp://{self.hosts['broker']}:{PORT}"

    def log(self, name: str) -> str:
        for n, _, path in self.procs:
            if n == name:
                return path.read_text(errors="replace")
        return ""

    def logs(self) -> str:
        return "\n".join(
            f"--- {n} ---\n{path.read_text(errors='replace')[-1500:]}" for n, _, path in self.procs
        )

    def cleanup(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, p, _ in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()
        # Deleting a namespace destroys its end of each veth pair, and with it the pair.
        for ns in reversed(self.namespaces):
            ip("netns", "del", ns, check=False)
        self.namespaces.clear()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    tag = secrets.token_hex(3)
    net = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
    lab = Lab(tag, net, tmp_path)
    try:
        try:
            lab.setup_switch()
        except RuntimeError as e:
            pytest.skip(f"cannot create network namespaces / a bridge here: {e}")
        yield lab
    finally:
        lab.cleanup()
        left = ip("netns", "list").stdout
        assert f"zpsns-{tag}" not in left, left


AGENT = """
import json, sys
import numpy as np
import zps

ps = zps.connect_sync(sys.argv[1], timeout=20, connect_timeout=20, name="netns-agent")
print(json.dumps({"ok": "connected"}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "status":
            out = ps.status()
        elif cmd["op"] == "pull_dense":
            out = np.unique(ps.pull_dense(cmd["name"])).tolist()
        elif cmd["op"] == "pull_rows":
            out = np.unique(ps.pull_rows(cmd["name"], cmd["ids"])).tolist()
        else:
            raise ValueError(cmd)
        reply = {"ok": out}
    except Exception as e:
        reply = {"error": repr(e)}
    print(json.dumps(reply, default=str), flush=True)
ps.close()
"""

JOB = """
import json, os
import numpy as np
import zps

def train(ps, stop_file, progress_file):
    ps.create_dense("w", shape=(40_000,), dtype="float64", optimizer=zps.optim.SGD(lr=1.0))
    ps.create_embedding("emb", dim=4, dtype="float64", optimizer=zps.optim.SGD(lr=1.0))
    ids = np.arange(0, 64, dtype=np.int64)
    n = 0
    while not os.path.exists(stop_file):
        ps.push_dense("w", np.ones(40_000))
        ps.push_rows("emb", ids, np.ones((64, 4)))
        n += 1
        w = ps.pull_dense("w")
        rows = ps.pull_rows("emb", ids)
        if not ((w == -n).all() and (rows == -n).all()):
            raise SystemExit(f"after {n} pushes: w {np.unique(w)}, rows {np.unique(rows)}")
        with open(progress_file + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(progress_file + ".tmp", progress_file)
    print(json.dumps({"pushes": n}))
"""


class Agent:
    """A client process in a namespace, answering one JSON command per line."""

    def __init__(self, popen: subprocess.Popen[bytes], lab: Lab) -> None:
        self.popen, self.lab = popen, lab
        self.read(30)  # connected

    def read(self, timeout: float) -> Any:
        assert self.popen.stdout is not None
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        line = self.popen.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"the agent did not answer in {timeout}s\n{self.lab.logs()}")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"agent: {reply['error']}")
        return reply["ok"]

    def ask(self, op: str, timeout: float = 30, **kw: Any) -> Any:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps({"op": op, **kw}).encode() + b"\n")
        self.popen.stdin.flush()
        return self.read(timeout)

    def wait_for(
        self, cond: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = self.ask("status")
            if cond(status):
                return status
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {status}\n{self.lab.logs()}")


def healthy(s: dict[str, Any]) -> bool:
    return all(
        p["state"] == "ok" and len(p["replicas"]) == 1 and p["replicas"][0]["in_sync"]
        for p in s["partitions"]
    )


def progress(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def wait_progress(path: Path, at_least: int, worker: subprocess.Popen[bytes], lab: Lab) -> int:
    deadline = time.monotonic() + 60
    while (n := progress(path)) < at_least:
        assert worker.poll() is None, f"the worker exited early\n{lab.logs()}"
        assert time.monotonic() < deadline, f"worker stuck at {n} pushes\n{lab.logs()}"
        time.sleep(0.02)
    return n


def test_failover_across_network_namespaces(lab: Lab) -> None:
    broker_ip = lab.node("broker", 1)
    shard_nodes = [f"s{i}" for i in range(4)]
    for i, node in enumerate(shard_nodes):
        lab.node(node, 11 + i)
    lab.node("worker", 31)
    lab.node("client", 32)

    lab.zps(
        "broker", "broker", "broker", "--bind", lab.broker_address, "--partitions", "2",
        "--replication", "2", "--startup-grace", "0",
    )  # fmt: skip
    shards = {node: lab.shard(f"shard-{node}", node) for node in shard_nodes}
    agent = Agent(
        lab.run("agent", "client", [sys.executable, "-c", AGENT, lab.broker_address], pipes=True),
        lab,
    )
    status = agent.wait_for(healthy, 60, "2 partitions x 2 copies")

    # Every shard registered from, and advertises, its own namespace's address.
    by_pid = {s["pid"]: s for s in status["shards"]}
    assert set(by_pid) == {p.pid for p in shards.values()}
    for node, p in shards.items():
        assert by_pid[p.pid]["address"].startswith(f"tcp://{lab.hosts[node]}:"), by_pid
    assert any(c["name"] == "netns-agent" for c in status["clients"])
    assert lab.broker_address == f"tcp://{broker_ip}:{PORT}"

    (lab.workdir / "job.py").write_text(textwrap.dedent(JOB))
    stop, prog = lab.workdir / "stop", lab.workdir / "progress"
    worker = lab.run(
        "worker",
        "worker",
        [sys.executable, "-m", "zps.worker_entry", "--broker", lab.broker_address,
         "--timeout", "30", "job:train", str(stop), str(prog)],
    )  # fmt: skip
    wait_progress(prog, 10, worker, lab)

    # SIGKILL the primary of partition 0 (in its own namespace) mid-run.
    p0 = status["partitions"][0]
    victim = next(s for s in status["shards"] if s["node"] == p0["primary"])
    victim_node = next(n for n, p in shards.items() if p.pid == victim["pid"])
    replica_pid = by_pid_of(status, p0["replicas"][0]["node"])
    os.kill(victim["pid"], signal.SIGKILL)
    shards[victim_node].wait(10)
    at_kill = progress(prog)
    status = agent.wait_for(
        lambda s: s["partitions"][0]["primary"] not in (None, victim["node"]),
        30,
        "a new primary of partition 0",
    )
    new = status["partitions"][0]
    assert new["epoch"] == p0["epoch"] + 1
    assert by_pid_of(status, new["primary"]) == replica_pid  # the replica next door
    assert status["failovers"] >= 1

    # A replacement in the dead shard's namespace (as systemd would restart it) re-syncs
    # from the new primary; until it is in sync, partition 0 holds one copy, and the
    # worker's acks="all" pushes wait (replication.min_in_sync = 2): it goes on across it.
    lab.shard(f"shard-{victim_node}-2", victim_node)
    wait_progress(prog, at_kill + 10, worker, lab)
    agent.wait_for(healthy, 60, "the replacement replica in sync")
    wait_progress(prog, progress(prog) + 5, worker, lab)

    stop.touch()
    assert worker.wait(60) == 0, lab.logs()
    m = re.search(r'\{"pushes": (\d+)\}', lab.log("worker"))
    assert m, lab.log("worker")
    pushes = int(m.group(1))
    assert pushes >= at_kill + 15
    # Exactly once, seen from the client's namespace: every element is -pushes.
    assert agent.ask("pull_dense", name="w") == [-float(pushes)]
    assert agent.ask("pull_rows", name="emb", ids=list(range(64))) == [-float(pushes)]


def by_pid_of(status: dict[str, Any], node: str) -> int:
    return int(next(s["pid"] for s in status["shards"] if s["node"] == node))
