"""The real shard in a simulated run (``--real-shard``, which implies ``--real-broker``).

:class:`RealShard` runs :class:`zps.shard.server.ShardServer` itself, unchanged, as a
process (:class:`~zps.testing.sim.aioloop.Proc`) on the run's one event loop: its
heartbeat loop, broker links and liveness links (:mod:`zps.shard.links`), request
pipeline, replication stream or subscription (:mod:`zps.shard.primary`,
:mod:`zps.shard.replica`, :mod:`zps.shard.snapshots`), the log's writer task
(:class:`~zps.shard.durability.Durability`) and checkpoints
(:mod:`zps.shard.checkpointing`), through the seams of :mod:`.shardnet` (transport,
clock, threads) and :mod:`.disk` (the files).  Its data dir is the node's
:class:`~zps.testing.sim.disk.Disk`.

A kill cancels the process's tasks at once (they unwind in the same simulated instant)
and closes its log without a sync, so its files keep what was written, as the page cache
does; a restart makes a new ``ShardServer`` on the same data dir.  A shard that exits on
its own (its log lost: :class:`~zps.shard.durability.LogLost`) is started again a second
later, as its service manager would, and so is one whose start failed (an unreadable
checkpoint).

The run's checks see the real shard as they see the stand-in
(:class:`~zps.testing.sim.nodes.SimShard`): its session and log (``session``, ``dur``),
each write it takes as primary (``World.on_write_taken``, from the request pipeline),
what its log synced (a restart must find it again), and the writes its primary holds for
the replicas (never past ``STALL`` while its lease is renewed).
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

from zps.ops.config import Checkpoint, Heartbeat, Replication, ShardConfig
from zps.protocol.messages import Role
from zps.shard.checkpoint import CheckpointError
from zps.shard.durability import Durability, LogLost
from zps.shard.server import ShardServer
from zps.shard.session import ShardSession
from zps.testing.sim import shardnet
from zps.testing.sim.aioloop import Proc, SimLoop
from zps.testing.sim.nodes import HB, LIVE, SEGMENT, STALL
from zps.testing.sim.realbroker import BIND
from zps.testing.sim.simtransport import SimNode

World = Any

#: The port a shard's replication ROUTER is advertised at (its host is its name).
REPLICATION_PORT = 7000


class RealShard:
    """One shard of the run: the real ``ShardServer`` as a simulated process."""

    def __init__(self, world: World, name: str) -> None:
        self.w = world
        self.name = name
        self.disk = world.new_disk(name)
        self.alive = False
        self.gen = 0
        #: (partition, LSN) its log synced last: a restart must find it again.
        self.was_durable: tuple[int | None, int] | None = None
        self.server: ShardServer | None = None
        self.session: ShardSession[Any] | None = None
        self.dur: Durability | None = None
        self.proc: Proc | None = None
        self.node: SimNode | None = None
        self.task: asyncio.Task[None] | None = None
        self._waiting: tuple[int, float] | None = None  # (LSN, since) of the oldest write held
        #: (partition, LSN) of a cut asked for and the log not started again since.
        self._cut: tuple[int | None, int] | None = None

    @property
    def loop(self) -> SimLoop:
        loop: SimLoop = self.w.loop
        return loop

    def config(self) -> ShardConfig:
        w = self.w
        brokers = tuple(f"sim://{b.name}" for b in w.brokers) if w.pair else (BIND,)
        config = ShardConfig(
            brokers=brokers,
            data_dir=str(self.disk.root),
            replication_bind=f"tcp://{self.name}:{REPLICATION_PORT}",
            advertise_host=self.name,
            host=w.hosts.get(self.name, self.name),  # its own unless two run on a host
            durability="fsync",
            shm_bytes=self.w.shm.budget if self.w.shm is not None else 0,
            heartbeat=Heartbeat(interval=HB, liveness=LIVE),
            checkpoint=Checkpoint(every_updates=40, keep=2),
            replication=Replication(min_in_sync=w.min_in_sync),
        )
        # Log segments of SEGMENT bytes, below what a configuration accepts: many
        # segments, and a roll at each checkpoint, in a run of a few hundred writes.
        object.__setattr__(config, "wal_segment_bytes", SEGMENT)
        return config

    # -- life --------------------------------------------------------------------

    def start(self) -> bool:
        w = self.w
        self.gen += 1
        self.node = shardnet.attach(self.name)
        proc = self.proc = Proc(self.name)
        rng, disk = w.sched.rng, self.disk
        proc.io_delay = lambda: 0.002 + rng.random() * 0.01 + disk.slow
        server = self.server = proc.context.run(ShardServer, self.config(), node_id=self.name)
        self.session, self.dur = server.session, server.durability
        self._watch(server)
        self.alive = True
        self._waiting = None
        self._cut = None
        task = self.task = self.loop.spawn(proc, server.run())
        task.add_done_callback(functools.partial(self._ended, self.gen))
        gen = self.gen
        w.sched.after(HB, lambda: self._check(gen))
        return True

    def crash(self) -> None:
        """The process is gone (killed, or its machine lost power): its log closes
        unsynced, its tasks are cancelled and unwind now; nothing of it runs on."""
        self.alive = False
        self.gen += 1
        server, proc = self.server, self.proc
        if server is not None and proc is not None and proc.alive:
            dur = server.durability
            wal, dur._wal = dur._wal, None
            if wal is not None:
                wal.close(sync=False)
            self.loop.kill(proc)
            self.loop.settle()
            if self.task is not None and not self.task.done():
                self.w.fail(f"{self.name}: its process did not unwind when killed")
        self.w.net.detach(self.name)
        shardnet.detach(self.name, self.node)

    def _ended(self, gen: int, task: asyncio.Task[None]) -> None:
        """The process ended on its own (not killed): a lost log, or a failed start."""
        if gen != self.gen or task.cancelled():
            return
        w, error = self.w, task.exception()
        if isinstance(error, LogLost):
            w.sched.log(f"{self.name} log lost; left and exits")
            w.sched.at(w.sched.now, lambda: w.stop_shard(self, restart_after=1.0))
            return
        if isinstance(error, CheckpointError):
            w.sched.log(f"{self.name} start refused: {error}")
            w.notices.append(("error", f"{self.name} start refused: {error}"))
        else:
            w.fail(f"{self.name}'s process ended: {error!r}")

        def again() -> None:
            if self.gen == gen and self.alive:
                self.crash()
                w.sched.after(1.0, lambda: w._restart(self, self.gen))

        w.sched.at(w.sched.now, again)

    # -- what the checks see ---------------------------------------------------------

    def _watch(self, server: ShardServer) -> None:
        """Hooks on this process's objects (not on the classes): the checks' view."""
        w, core, session, dur = self.w, server.core, server.session, server.durability
        restore, request = server.checkpoints.restore, server.requests.request
        assign, release = session.assign, dur._release

        def restored() -> None:
            restore()  # CheckpointError: the start fails
            p, lsn = session.partition, core.lsn
            if self.was_durable is not None:
                was_p, was_lsn = self.was_durable
                got = (p, lsn) if p is not None else None
                if was_lsn > 0 and (got is None or got[0] != was_p or got[1] < was_lsn):
                    w.fail(f"{self.name} restarted with {got} (partition, LSN) where its log "
                           f"had partition {was_p} synced to LSN {was_lsn}: a synced record "
                           "was lost")  # fmt: skip
            if p is not None:
                w.sched.log(f"{self.name} restored p{p} e{session.epoch} lsn {lsn}")

        def requested(source: bytes, route: Any, frames: list[Any]) -> None:
            before = core.lsn
            request(source, route, frames)
            if core.lsn != before and core.primary and core.partition is not None:
                w.on_write_taken(self, core.partition, core.epoch)

        def assigned(
            role: Role,
            partition: int | None,
            epoch: int,
            address: str = "",
            *,
            lsn: int = 0,
            term: int = 0,
        ) -> Any:
            change = assign(role, partition, epoch, address, lsn=lsn, term=term)
            if change.register_again:
                w.sched.log(f"{self.name} refuses primary p={partition} e={epoch}")
            if change.changed:
                w.sched.log(f"{self.name} assigned {role.value} p={partition} e={epoch}")
                if partition != change.was[1]:
                    self.was_durable = None  # another partition's log from now on
            return change

        def released(*, force: bool = False) -> None:
            # A batch synced: what the log holds, while it is the log of the partition
            # the shard holds (a spare, or a copy of another partition, keeps the old
            # one open until it starts a new one: a restart may restore either).
            if not force and dur.waits and dur.partition == session.partition:
                cut_to = self._cut[1] if self._cut and self._cut[0] == dur.partition else None
                durable = dur.durable if cut_to is None else min(dur.durable, cut_to)
                self.was_durable = (dur.partition, durable)
            release(force=force)

        cut_after, start = dur.cut_after, dur.start

        def cut(folder: Path, lsn: int) -> Any:
            # The records past ``lsn`` of a history a snapshot replaces are set aside
            # (Durability.cut_after: never acknowledged past the copies in sync): a
            # restart need not find them, until the log starts again at the snapshot
            # (its counters say the old history's LSN meanwhile).  Lowered as the cut
            # is asked for: a restart before it is done finds more, never less.
            if self.was_durable is not None and folder.name == f"partition-{self.was_durable[0]}":
                self.was_durable = (self.was_durable[0], min(self.was_durable[1], lsn))
                self._cut = self.was_durable
            return cut_after(folder, lsn)

        def started(folder: Path, partition: int, base: int) -> None:
            self._cut = None
            start(folder, partition, base)

        dur.cut_after = cut  # type: ignore[method-assign]
        dur.start = started  # type: ignore[method-assign]
        server.checkpoints.restore = restored  # type: ignore[method-assign]
        server.requests.request = requested  # type: ignore[method-assign]
        session.assign = assigned  # type: ignore[method-assign,assignment]
        dur._release = released  # type: ignore[method-assign]

    def _check(self, gen: int) -> None:
        """A write waits for replicas at most until the broker drops the silent ones: a
        primary whose lease the broker keeps renewing never holds one for STALL seconds."""
        if gen != self.gen or not self.alive or self.session is None:
            return
        w, now = self.w, self.w.sched.now
        self.w.sched.after(HB, lambda: self._check(gen))
        if self.name in w.net.paused:
            return
        waiting = self.session.tracker._waiting
        if not waiting:
            self._waiting = None
            return
        lsn = waiting[0][0]
        if self._waiting is None or self._waiting[0] != lsn:
            self._waiting = (lsn, now)
        since = self._waiting[1]
        if now - since > STALL and self.session.may_write(now):
            required = sorted(self.session.tracker.required)
            w.fail(f"{self.name}: a write at LSN {lsn} has waited for the replicas "
                   f"{now - since:.2f}s (required: {required})")  # fmt: skip
            self._waiting = (lsn, now)  # reported once per STALL

    def end(self) -> None:
        """The end of the run: the process ends as a kill ends it (untraced)."""
        if self.alive:
            self.crash()
