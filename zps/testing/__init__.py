"""Helpers to run a real local cluster: broker and shards as processes on loopback.

Used by the integration tests and by ``zps-server demo``.  Every process is
started with its output in a log file under ``workdir`` and is stopped (TERM,
then KILL) by :meth:`LocalCluster.stop`, also when start-up fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zps.client.client import connect
from zps.core.routing import partitions_of_ids
from zps.errors import ZpsError, ZpsTimeoutError
from zps.optim import SGD

if TYPE_CHECKING:
    from zps.client.sync import SyncClient

_handed_out: set[int] = set()
#: How often :meth:`LocalCluster.wait_for` asks the broker for its status.
POLL_S = 0.02


def _port_range() -> range:
    """Ports the kernel never picks for an unbound socket: outside its ephemeral range.

    A port taken from the ephemeral range (``bind(0)``) can be given, a moment later,
    to any outgoing connection as its local port, and the process that meant to bind it
    then fails with "Address already in use".
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    below = range(max(1024, lo - 12000), lo)
    above = range(hi + 1, 65536)
    return below if len(below) >= len(above) else above


def scrape_metric(port: int, name: str, default: float | None = None) -> float:
    """The value of the series ``name`` (unlabelled; a counter's ``_total`` may be left
    off) at the metrics endpoint of 127.0.0.1:``port``; ``default`` when it is absent
    (None: an AssertionError saying so)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}(?:_total)? (\S+)$", text, re.MULTILINE)
    if m is None:
        assert default is not None, f"no {name} in the metrics at port {port}"
        return default
    return float(m.group(1))


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in the main thread, so a benchmark or script killed
    by ``timeout`` or its service manager unwinds its ``with LocalCluster(...)`` blocks
    and stops every process it started (by default SIGTERM ends it at once and leaves
    them running)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's
    ephemeral range and not handed out before by this process."""
    ports = _port_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class LocalCluster:
    partitions: int = 2
    shards: int = 2
    replication: int = 1
    #: Start-up hold of the broker (see BrokerConfig.startup_grace); 0 for a
    #: fresh cluster, where no shard has anything to claim.
    startup_grace: float = 0.0
    #: Extra command-line arguments for every broker / shard started.
    broker_args: list[str] = field(default_factory=list)
    shard_args: list[str] = field(default_factory=list)
    heartbeat_interval: float = 0.1
    liveness: int = 10
    workdir: Path | None = None
    log_level: str = "info"
    #: Tell every process its log file is the journald stream (``$JOURNAL_STREAM``).
    journal: bool = False
    #: The broker's data dir (its state survives restarts), or None.
    broker_data_dir: Path | None = None
    #: Placement labels: shard i reports ``shard_hosts[i % len]`` as its host.
    shard_hosts: list[str] = field(default_factory=list)
    python: str = sys.executable
    procs: list[Proc] = field(default_factory=list)
    port: int = 0
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Make `python -m zps` find this very package, installed or not.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def spawn(self, name: str, args: list[str]) -> Proc:
        assert self.workdir is not None
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "wb") as out:
            env = self.env()
            if self.journal:
                st = os.fstat(out.fileno())
                env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
            popen = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.workdir,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def common_args(self) -> list[str]:
        """The flags every process of this cluster is started with (heartbeat interval,
        liveness, log level), for a test that starts one itself."""
        return [
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            "--liveness",
            str(self.liveness),
            "--log-level",
            self.log_level,
        ]

    def start_broker(self, grace: float | None = None) -> Proc:
        """Start a broker (again: after a restart, name it broker1, broker2, ...)."""
        n = sum(p.name.startswith("broker") for p in self.procs)
        grace = self.startup_grace if grace is None else grace
        return self.spawn(
            f"broker{n or ''}",
            [
                self.python,
                "-m",
                "zps",
                "broker",
                "--bind",
                self.address,
                "--partitions",
                str(self.partitions),
                "--replication",
                str(self.replication),
                "--startup-grace",
                str(grace),
                *self.common_args(),
                *(["--data-dir", str(self.broker_data_dir)] if self.broker_data_dir else []),
                *self.broker_args,
            ],
        )

    def start_shard(self, extra: Sequence[str] = ()) -> Proc:
        n = sum(p.name.startswith("shard") for p in self.procs)
        return self.spawn(
            f"shard{n}",
            [
                self.python,
                "-m",
                "zps",
                "shard",
                "--broker",
                self.address,
                "--replication-bind",
                "tcp://127.0.0.1:0",
                "--advertise-host",
                "127.0.0.1",
                *self.common_args(),
                *(
                    ["--host", self.shard_hosts[n % len(self.shard_hosts)]]
                    if self.shard_hosts
                    else []
                ),
                *self.shard_args,
                *extra,
            ],
        )

    def prepare(self) -> None:
        """Choose the port (unless set) and the working directory (unless set: a
        temporary one, removed by :meth:`stop`), starting nothing: for a test that
        starts the processes itself, in an order of its own."""
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="zps-cluster-")
            self.workdir = Path(self._tmp.name)
        self.port = self.port or free_port()

    def start(self, timeout: float = 30.0) -> LocalCluster:
        self.prepare()
        try:
            self.start_broker()
            for _ in range(self.shards):
                self.start_shard()
            # Healthy, and every shard registered: spares too (a test that scales or
            # fails over counts on them).
            self.wait_for(
                lambda s: self.healthy(s) and len(s["shards"]) >= self.shards,
                timeout,
                f"every partition fully replicated and all {self.shards} shards registered",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def status_client(self, timeout: float) -> SyncClient:
        """A client for the harness's status polls (:meth:`status`, :meth:`wait_for`);
        a cluster with keys overrides it to present an allowed key."""
        from zps.client.sync import connect_sync

        return connect_sync(
            self.address, connect_timeout=timeout, timeout=timeout, name="zps.testing"
        )

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        with self.status_client(timeout) as ps:
            return ps.status()

    def wait_for(
        self, condition: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        """Poll the broker's status until ``condition`` holds, through one client kept
        for the wait (a client that fails is dropped and a fresh one connects)."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        client: SyncClient | None = None
        try:
            while time.monotonic() < deadline:
                for proc in self.procs:
                    if proc.name == self.broker_name() and not proc.alive():
                        raise ZpsError(f"the broker exited early:\n{proc.log()[-3000:]}")
                fresh = client is None
                if client is None:
                    wait = min(2.0, max(0.1, deadline - time.monotonic()))
                    try:
                        client = self.status_client(wait)
                    except ZpsTimeoutError:
                        continue
                try:
                    last = client.status()
                except ZpsError as e:
                    client.close()
                    client = None
                    if fresh and not isinstance(e, ZpsTimeoutError):
                        raise  # not the stale session of a client kept across a restart
                    continue
                if condition(last):
                    return last
                time.sleep(POLL_S)
        finally:
            if client is not None:
                client.close()
        raise ZpsTimeoutError(
            f"timed out after {timeout:g}s waiting for {what}; last status: {last}\n{self.logs()}"
        )

    def scale(
        self,
        partitions: int | None = None,
        *,
        cancel: bool = False,
        timeout: float = 10.0,
        max_slots: int = 0,
        piece_bytes: int = 0,
    ) -> dict[str, Any]:
        """``zps-server scale``: ask the broker to reshard to ``partitions`` (or cancel the
        move under way); the broker's answer (``{"ok", "msg"}``)."""
        from zps.protocol.messages import StatusRequest

        async def ask() -> dict[str, Any]:
            request = StatusRequest(
                scale=partitions,
                scale_cancel=cancel,
                scale_max_slots=max_slots,
                scale_piece_bytes=piece_bytes,
            )
            async with connect(self.address, timeout=timeout, name="zps.testing") as ps:
                report = await ps.status(request)
            return dict(report["scale"])

        return asyncio.run(ask())

    def wait_resharded(self, partitions: int, timeout: float = 60.0) -> dict[str, Any]:
        """Until the broker has no resharding under way and serves ``partitions``."""
        return self.wait_for(
            lambda s: (
                (s.get("reshard") or {}).get("target") is None
                and s["n_partitions"] == partitions
                and all(p["state"] in ("ok", "degraded") for p in s["partitions"])
            ),
            timeout,
            f"resharding to {partitions} partitions",
        )

    def healthy(self, status: dict[str, Any]) -> bool:
        """Every partition has a primary and all its replicas in sync."""
        return all(
            p["state"] == "ok"
            and len(p["replicas"]) == self.replication - 1
            and all(r["in_sync"] for r in p["replicas"])
            for p in status["partitions"]
        )

    def wait_healthy(self, timeout: float = 30.0) -> dict[str, Any]:
        return self.wait_for(self.healthy, timeout, "every partition to be fully replicated")

    def shard_pid(self, partition: int) -> int:
        for s in self.status()["shards"]:
            if s["partition"] == partition and s["role"] == "primary":
                return int(s["pid"])
        raise ZpsError(f"no primary for partition {partition}")

    def proc_by_pid(self, pid: int) -> Proc:
        for p in self.procs:
            if p.pid == pid:
                return p
        raise ZpsError(f"no process {pid} in this cluster")

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            self.proc_by_pid(pid).popen.wait(10)

    def broker_name(self) -> str:
        return [p.name for p in self.procs if p.name.startswith("broker")][-1]

    def broker(self) -> Proc:
        return next(p for p in reversed(self.procs) if p.name.startswith("broker"))

    def wait_gone(self, pid: int, timeout: float = 20.0) -> dict[str, Any]:
        """Until the broker has dropped the shard with ``pid`` from its map."""
        return self.wait_for(
            lambda s: all(x["pid"] != pid for x in s["shards"]),
            timeout,
            f"the broker to notice that pid {pid} is gone",
        )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (pid {p.pid}) ---\n{p.log()[-2000:]}" for p in self.procs)

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGCONT)
                    p.popen.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class DataDirCluster(LocalCluster):
    """A LocalCluster whose shards may each get a data dir (and other flags), and whose
    broker can be started again on the same port."""

    def start_shard(  # type: ignore[override]
        self, data_dir: Path | None = None, extra: Sequence[str] = ()
    ) -> Proc:
        args = ["--data-dir", str(data_dir)] if data_dir is not None else []
        return super().start_shard([*args, *extra])

    def restart_broker(self, grace: float | None = None, timeout: float = 60.0) -> Proc:
        """A fresh broker on the same port, so it rebuilds its map from the restarted
        shards' claims: with its default start-up hold (two liveness timeouts), or with
        ``grace`` seconds of hold once every running shard has restored its data and is
        connecting (within ``timeout``), as then each claim comes as the broker binds.
        The broker routes no request while it holds, even for a claimed partition."""
        if grace is not None:
            self.wait_connecting(timeout)
        n = sum(p.name.startswith("broker") for p in self.procs)
        hold = [] if grace is None else ["--startup-grace", str(grace)]
        return self.spawn(
            f"broker{n}",
            [sys.executable, "-m", "zps", "broker", "--bind", self.address,
             "--partitions", str(self.partitions), "--replication", str(self.replication),
             *hold, *self.common_args()],
        )  # fmt: skip

    def wait_connecting(self, timeout: float) -> None:
        """Until every running shard's log says it is connecting to the broker (it has
        restored what its data dir holds: its claim goes out as the broker answers)."""
        deadline = time.monotonic() + timeout
        shards = [p for p in self.procs if p.name.startswith("shard") and p.alive()]
        while True:
            waiting = [p for p in shards if not re.search(r"\) connecting to ", p.log())]
            if not waiting:
                return
            for p in waiting:
                if not p.alive():
                    raise ZpsError(f"{p.name} exited before connecting:\n{p.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise ZpsTimeoutError(
                    f"timed out after {timeout:g}s waiting for {[p.name for p in waiting]} "
                    f"to connect\n{self.logs()}"
                )
            time.sleep(POLL_S)


@dataclass
class PairCluster(LocalCluster):
    """A :class:`LocalCluster` whose broker is a primary/backup pair (hot standby).

    :attr:`address` names both brokers (``A,B``); :meth:`restart_broker` brings a
    killed one back in its role.
    """

    peer_timeout: float = 0.5
    ports: list[int] = field(default_factory=list)  # [public A, public B, peer A, peer B]

    @property
    def address(self) -> str:
        return f"{self.endpoint(0)},{self.endpoint(1)}"

    def endpoint(self, i: int) -> str:
        return f"tcp://127.0.0.1:{self.ports[i]}"

    def start_broker(self, grace: float | None = None) -> Proc:
        """Start both brokers (the primary, then the backup); returns the backup."""
        if not self.ports:
            self.ports = [free_port() for _ in range(4)]
        self.port = self.ports[0]
        self.start_member("primary", grace)
        return self.start_member("backup", grace)

    def start_member(self, role: str, grace: float | None = None) -> Proc:
        i = 0 if role == "primary" else 1
        n = sum(p.name.startswith(f"broker-{role}") for p in self.procs)
        return self.spawn(
            f"broker-{role}{n or ''}",
            [
                self.python,
                "-m",
                "zps",
                "broker",
                "--bind",
                self.endpoint(i),
                "--pair-role",
                role,
                "--peer-bind",
                f"tcp://127.0.0.1:{self.ports[2 + i]}",
                "--peer",
                f"tcp://127.0.0.1:{self.ports[3 - i]}",
                "--peer-timeout",
                str(self.peer_timeout),
                "--partitions",
                str(self.partitions),
                "--replication",
                str(self.replication),
                "--startup-grace",
                str(self.startup_grace if grace is None else grace),
                *self.common_args(),
                # each broker of the pair has a data dir of its own (ROLE under broker_data_dir)
                *(["--data-dir", str(self.broker_data_dir / role)] if self.broker_data_dir else []),
                *self.broker_args,
            ],
        )

    def restart_broker(self, proc: Proc) -> Proc:
        """Start again the broker of ``proc`` (killed), in the same role."""
        return self.start_member("primary" if "primary" in proc.name else "backup")

    def active_broker(self, timeout: float = 5.0) -> Proc:
        """The broker process that answers as the active one."""
        return self.proc_by_pid(int(self.status(timeout)["broker"]["pid"]))


@dataclass
class _Writer:
    partition: int
    ids: Any  # int64 ids that all live on ``partition``
    acked: float = 0.0  # sum of acknowledged gradient values
    pushes: int = 0
    errors: list[BaseException] = field(default_factory=list)
    acks: list[tuple[float, float]] = field(default_factory=list)  # (sent, acknowledged)


class ExactSumLoad:
    """Pushes integer-valued float64 gradients with SGD(lr=1), remembering each ack.

    One writer per (client, partition) pushes the value ``k`` to a fixed set of
    rows of that partition (and the same to a dense tensor).  Every value is
    exact in float64, so at the end each row must equal exactly minus the sum
    of the acknowledged pushes: a lost write or a doubled one shows.
    """

    def __init__(
        self,
        address: str,
        *,
        clients: int = 2,
        rows_per_partition: int = 64,
        dim: int = 4,
        table: str = "chaos",
        timeout: float = 60.0,
    ) -> None:
        self.address = address
        self.n_clients = clients
        self.rows = rows_per_partition
        self.dim = dim
        self.table = table
        self.timeout = timeout
        self.writers: list[list[_Writer]] = []

    async def setup(self) -> None:
        async with connect(self.address, timeout=self.timeout) as ps:
            await ps.create_embedding(
                self.table, dim=self.dim, dtype="float64", optimizer=SGD(lr=1.0)
            )
            candidates = np.arange(1, 200_000, dtype=np.int64)
            owner = partitions_of_ids(candidates, ps.cluster_map)
            n_parts = ps.cluster_map.n_partitions
        self.writers = []
        for c in range(self.n_clients):
            row: list[_Writer] = []
            for p in range(n_parts):
                mine = candidates[owner == p][c * self.rows : (c + 1) * self.rows]
                row.append(_Writer(p, mine))
            self.writers.append(row)

    async def run(self, stop: Any) -> None:
        """Push until ``stop`` (an asyncio.Event) is set; then return."""
        await asyncio.gather(*(self._client(c, stop) for c in range(self.n_clients)))

    async def _client(self, c: int, stop: Any) -> None:
        async with connect(self.address, timeout=self.timeout, name=f"exact-sum-{c}") as ps:

            async def write(w: _Writer) -> None:
                while not stop.is_set():
                    value = float(w.pushes % 7 + 1)
                    grads = np.full((w.ids.size, self.dim), value)
                    sent = time.monotonic()
                    try:
                        await ps.push_rows(self.table, w.ids, grads)
                    except Exception as e:  # recorded: the verdict fails on any error
                        w.errors.append(e)
                        return
                    w.acked += value
                    w.pushes += 1
                    w.acks.append((sent, time.monotonic()))

            await asyncio.gather(*(write(w) for w in self.writers[c]))

    async def verify(self) -> list[str]:
        """Differences between the servers' values and the acknowledged sums."""
        problems = [
            f"client {c} partition {w.partition}: {e!r}"
            for c, row in enumerate(self.writers)
            for w in row
            for e in w.errors
        ]
        async with connect(self.address, timeout=self.timeout) as ps:
            for c, row in enumerate(self.writers):
                for w in row:
                    got = await ps.pull_rows(self.table, w.ids)
                    if not np.array_equal(got, np.full_like(got, -w.acked)):
                        vals = np.unique(got)
                        problems.append(
                            f"client {c} partition {w.partition}: expected "
                            f"{-w.acked} after {w.pushes} acks, found {vals[:5]}"
                        )
        return problems

    def failover_time(self, partition: int, killed_at: float) -> float | None:
        """Seconds from ``killed_at`` to the first ack of a push sent after it."""
        firsts = [
            ack
            for row in self.writers
            for w in row
            if w.partition == partition
            for sent, ack in w.acks
            if sent >= killed_at
        ]
        return min(firsts) - killed_at if firsts else None

    @property
    def total_pushes(self) -> int:
        return sum(w.pushes for row in self.writers for w in row)


async def acked_after(
    load: ExactSumLoad, t0: float, timeout: float = 30.0, *, sent: bool = False
) -> None:
    """Until every writer of ``load`` had a push acknowledged after ``t0`` (``sent``: one
    sent after it, so not one the fault found in flight); a writer's error, or
    ``timeout`` seconds, fails the wait."""
    at = 0 if sent else 1  # in each (sent, acknowledged) pair
    deadline = time.monotonic() + timeout
    while not all(any(pair[at] > t0 for pair in w.acks) for row in load.writers for w in row):
        errors = [e for row in load.writers for w in row for e in w.errors]
        assert not errors, errors
        assert time.monotonic() < deadline, "writers still stalled after the fault"
        await asyncio.sleep(0.01)
