"""The broker state that must outlive the broker process, as one record.

What a broker must never forget: which partitions exist, the epoch and the
highest LSN a primary confirmed for each (so a restarted broker never hands a
known partition to an empty shard, nor to a copy older than the one it knew),
the map version, and the training jobs (clocks, sync commits, task queues).
Each partition's last in-sync set (its primary and the replicas the primary
counted for ``acks="all"``) is kept too: every acknowledged write is on each of
those copies, so after a crash only one of them may serve the partition.
Under CURVE, the key each shard name was first registered with is kept too (a
name outlives its key's process: no other key may take it).  Everything else
(who serves what now, clients) is rebuilt from the shards' claims and the
clients' re-sent calls after a restart.

Rules:

1. A record is self-contained: loading one needs no earlier record, so the
   same bytes serve a file on disk and a peer that mirrors the broker.
2. ``version`` grows by one with every record a broker produces, across
   restarts (a broker that loaded version v produces v + 1 next); of two
   records the one with the higher version is newer.
3. :meth:`BrokerState.from_bytes` and :meth:`BrokerState.from_dict` check
   every field and raise only :class:`BrokerStateError`, naming the field.
4. No I/O: the broker driver writes the bytes (``zps/broker/statefile.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import numpy as np

from zps.protocol.messages import Mode

#: The layout of :meth:`BrokerState.to_dict`; a reader refuses any other.  Format 2
#: adds the slot map and the live resharding under way, format 3 each partition's
#: in-sync set (formats 1 and 2 are still read).
FORMAT = 3
_READS = (1, 2, 3)
_KIND = "zps-broker-state"


class BrokerStateError(ValueError):
    """A state record that cannot be read: names the field that is wrong."""


@dataclass(frozen=True)
class PartitionRecord:
    """One partition: ``epoch`` is the broker's current one; ``floor_epoch`` and
    ``floor_lsn`` the newest (epoch, LSN) a primary confirmed by heartbeat, which a
    copy must reach before the broker trusts it with the partition again."""

    epoch: int = 0
    floor_epoch: int = 0
    floor_lsn: int = 0
    #: Hosts its copies were last on (for the operator's eyes only).
    hosts: tuple[str, ...] = ()
    #: Its last in-sync set, primary first: the copies holding every acknowledged
    #: write (empty: not known, as in records written before it was kept).
    in_sync: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        """Whether the partition ever held data (an empty shard may not take it)."""
        return self.epoch > 0


@dataclass(frozen=True)
class ClockRecord:
    """A job's worker clocks and its sync-mode commit state (see zps.core.coord)."""

    mode: Mode | None = None
    tau: int = 0
    #: (worker, steps finished, waiting to be released)
    workers: tuple[tuple[str, int, bool], ...] = ()
    committed: int = -1
    committing: int | None = None
    commit_workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobRecord:
    """A data job: its settings and where every task is (tasks are rebuilt from the
    settings, so only task ids are kept)."""

    name: str
    n_records: int
    per_task: int
    epochs: int
    max_retries: int
    seed: int
    queue: tuple[int, ...] = ()
    #: (task id, worker holding it)
    held: tuple[tuple[int, str], ...] = ()
    #: (task id, returns counted)
    retries: tuple[tuple[int, int], ...] = ()
    done: tuple[int, ...] = ()
    failed: str | None = None
    #: Cancelled by an operator: no more tasks are handed out.
    cancelled: bool = False
    #: (task id, worker) held when the job was reset (their reports count for nothing).
    orphaned: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class ReshardRecord:
    """Live resharding under way: the partition count it goes to, and the move in
    flight (if any): its slots, source, destination and how far it got (``copying``:
    cancelled by a broker that takes over; ``copied``: the destination holds every
    slot, so a broker that takes over completes it)."""

    target: int
    source: int = -1
    dest: int = -1
    slots: tuple[int, ...] = ()
    stage: str = ""

    STAGES = ("", "copying", "copied")


@dataclass(frozen=True)
class BrokerState:
    """Everything a broker persists (and would stream to a standby); see the rules."""

    version: int
    n_partitions: int
    n_slots: int
    replication: int
    map_version: int
    partitions: tuple[PartitionRecord, ...]
    clocks: ClockRecord = field(default_factory=ClockRecord)
    jobs: tuple[JobRecord, ...] = ()
    #: The slot -> partition map (``n_slots`` little-endian int32); empty: round-robin.
    slot_map: bytes = b""
    reshard: ReshardRecord | None = None
    #: CURVE: (shard node id, the Z85 public key it is bound to), sorted by node id;
    #: absent from records written before it was kept (read as none).
    shard_keys: tuple[tuple[str, str], ...] = ()
    #: A broker pair: the term of the active broker that produced the record (0: none,
    #: or written before it was kept); of two pair records the one with the higher
    #: ``(term, map_version)`` is newer.
    term: int = 0
    #: (partition, epoch): the highest epoch each partition removed by scaling down
    #: had reached, sorted (a partition made again starts past it); absent from
    #: records written before it was kept (read as none).
    retired: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.partitions) != self.n_partitions:
            raise BrokerStateError(
                f"partitions: {len(self.partitions)} records for {self.n_partitions} partitions"
            )
        if self.slot_map and len(self.slot_map) != 4 * self.n_slots:
            raise BrokerStateError(f"slot_map: {len(self.slot_map)} bytes for {self.n_slots} slots")

    def same_content(self, other: BrokerState | None) -> bool:
        """Equal but for the version (nothing new to write)."""
        return other is not None and replace(other, version=self.version) == self

    def floors_only_differ(self, other: BrokerState | None) -> bool:
        """Equal but for the version and some partitions' LSN floors (heartbeat news,
        which may wait a little; a new floor epoch may not)."""
        if other is None or other.n_partitions != self.n_partitions:
            return False
        return _without_floors(self) == _without_floors(other)

    # -- encoding ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        c = self.clocks
        return {
            "kind": _KIND,
            "format": FORMAT,
            "version": self.version,
            "n_partitions": self.n_partitions,
            "n_slots": self.n_slots,
            "replication": self.replication,
            "map_version": self.map_version,
            "partitions": [
                [p.epoch, p.floor_epoch, p.floor_lsn, list(p.hosts), list(p.in_sync)]
                for p in self.partitions
            ],
            "clocks": {
                "mode": c.mode.value if c.mode else None,
                "tau": c.tau,
                "workers": [list(w) for w in c.workers],
                "committed": c.committed,
                "committing": c.committing,
                "commit_workers": list(c.commit_workers),
            },
            "jobs": [
                {
                    "name": j.name,
                    "settings": [j.n_records, j.per_task, j.epochs, j.max_retries, j.seed],
                    "queue": list(j.queue),
                    "held": [list(h) for h in j.held],
                    "retries": [list(r) for r in j.retries],
                    "done": _to_ranges(j.done),
                    "failed": j.failed,
                    "cancelled": j.cancelled,
                    "orphaned": [list(o) for o in j.orphaned],
                }
                for j in self.jobs
            ],
            "slot_map": self.slot_map,
            "reshard": None
            if self.reshard is None
            else {
                "target": self.reshard.target,
                "move": [
                    self.reshard.source,
                    self.reshard.dest,
                    list(self.reshard.slots),
                    self.reshard.stage,
                ],
            },
            "shard_keys": [list(b) for b in self.shard_keys],
            "term": self.term,
            "retired": [list(r) for r in self.retired],
        }

    def to_bytes(self) -> bytes:
        return bytes(msgpack.packb(self.to_dict(), use_bin_type=True))

    @classmethod
    def from_bytes(cls, raw: bytes) -> BrokerState:
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise BrokerStateError(f"not a msgpack record: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: object) -> BrokerState:
        d = _map(data, "state")
        if d.get("kind") != _KIND:
            raise BrokerStateError(f"kind: not a zps broker state ({d.get('kind')!r})")
        if d.get("format") not in _READS:
            raise BrokerStateError(
                f"format: {d.get('format')!r} (this zps reads formats {_READS} only)"
            )
        parts = []
        for i, raw in enumerate(_list(d.get("partitions"), "partitions")):
            row = _list(raw, f"partitions[{i}]")
            if len(row) not in (4, 5):
                raise BrokerStateError(f"partitions[{i}]: 4 or 5 fields expected, got {len(row)}")
            epoch, floor_epoch, floor_lsn = (
                _int(v, f"partitions[{i}].{k}")
                for v, k in zip(row[:3], ("epoch", "floor_epoch", "floor_lsn"), strict=True)
            )
            if floor_epoch > epoch:
                raise BrokerStateError(
                    f"partitions[{i}].floor_epoch: {floor_epoch} is past epoch {epoch}"
                )
            hosts = tuple(_str(h, f"partitions[{i}].hosts") for h in _list(row[3], "hosts"))
            in_sync = (
                tuple(_str(n, f"partitions[{i}].in_sync") for n in _list(row[4], "in_sync"))
                if len(row) == 5
                else ()
            )
            parts.append(PartitionRecord(epoch, floor_epoch, floor_lsn, hosts, in_sync))
        c = _map(d.get("clocks"), "clocks")
        mode = c.get("mode")
        if mode is not None and mode not in {m.value for m in Mode}:
            raise BrokerStateError(f"clocks.mode: {mode!r} is not a training mode")
        workers = []
        for i, raw in enumerate(_list(c.get("workers"), "clocks.workers")):
            w = _list(raw, f"clocks.workers[{i}]")
            if len(w) != 3 or not isinstance(w[2], bool):
                raise BrokerStateError(f"clocks.workers[{i}]: [name, step, waiting] expected")
            workers.append((_str(w[0], "clocks.workers"), _int(w[1], "clocks.workers"), w[2]))
        committing = c.get("committing")
        clocks = ClockRecord(
            mode=Mode(mode) if mode is not None else None,
            tau=_int(c.get("tau"), "clocks.tau"),
            workers=tuple(workers),
            committed=_int(c.get("committed"), "clocks.committed", lo=-1),
            committing=None if committing is None else _int(committing, "clocks.committing"),
            commit_workers=tuple(
                _str(w, "clocks.commit_workers")
                for w in _list(c.get("commit_workers"), "clocks.commit_workers")
            ),
        )
        jobs = [_job(raw, i) for i, raw in enumerate(_list(d.get("jobs"), "jobs"))]
        if len({j.name for j in jobs}) != len(jobs):
            raise BrokerStateError("jobs: a job name appears twice")
        n_partitions = _int(d.get("n_partitions"), "n_partitions", lo=1)
        n_slots = _int(d.get("n_slots"), "n_slots", lo=1)
        slot_map = d.get("slot_map", b"")
        if not isinstance(slot_map, bytes) or (slot_map and len(slot_map) != 4 * n_slots):
            raise BrokerStateError(f"slot_map: {4 * n_slots} bytes (or none) expected")
        if slot_map:
            arr = np.frombuffer(slot_map, dtype="<i4")
            if int(arr.min()) < 0 or int(arr.max()) >= n_partitions:
                raise BrokerStateError(f"slot_map: names a partition outside 0..{n_partitions - 1}")
        reshard = _reshard(d.get("reshard"), n_slots)
        shard_keys = []
        for i, raw in enumerate(_list(d.get("shard_keys", []), "shard_keys")):
            b = _list(raw, f"shard_keys[{i}]")
            if len(b) != 2:
                raise BrokerStateError(f"shard_keys[{i}]: [node, key] expected")
            shard_keys.append((_str(b[0], "shard_keys.node"), _str(b[1], "shard_keys.key")))
        retired = []
        for i, raw in enumerate(_list(d.get("retired", []), "retired")):
            r = _list(raw, f"retired[{i}]")
            if len(r) != 2:
                raise BrokerStateError(f"retired[{i}]: [partition, epoch] expected")
            retired.append((_int(r[0], "retired.partition"), _int(r[1], "retired.epoch")))
        return cls(
            version=_int(d.get("version"), "version"),
            n_partitions=n_partitions,
            n_slots=n_slots,
            replication=_int(d.get("replication"), "replication", lo=1),
            map_version=_int(d.get("map_version"), "map_version"),
            partitions=tuple(parts),
            clocks=clocks,
            jobs=tuple(jobs),
            slot_map=slot_map,
            reshard=reshard,
            shard_keys=tuple(shard_keys),
            term=_int(d.get("term", 0), "term"),
            retired=tuple(retired),
        )


def _reshard(raw: object, n_slots: int) -> ReshardRecord | None:
    if raw is None:
        return None
    r = _map(raw, "reshard")
    target = _int(r.get("target"), "reshard.target", lo=1)
    move = _list(r.get("move"), "reshard.move")
    if len(move) != 4:
        raise BrokerStateError("reshard.move: [source, dest, slots, stage] expected")
    source = _int(move[0], "reshard.move.source", lo=-1)
    dest = _int(move[1], "reshard.move.dest", lo=-1)
    slots = tuple(_int(s, "reshard.move.slots") for s in _list(move[2], "reshard.move.slots"))
    if any(s >= n_slots for s in slots):
        raise BrokerStateError(f"reshard.move.slots: a slot outside 0..{n_slots - 1}")
    stage = _str(move[3], "reshard.move.stage")
    if stage not in ReshardRecord.STAGES:
        raise BrokerStateError(f"reshard.move.stage: {stage!r}")
    return ReshardRecord(target, source, dest, slots, stage)


def _without_floors(s: BrokerState) -> BrokerState:
    return replace(s, version=0, partitions=tuple(replace(p, floor_lsn=0) for p in s.partitions))


def _job(raw: object, i: int) -> JobRecord:
    where = f"jobs[{i}]"
    j = _map(raw, where)
    settings = _list(j.get("settings"), f"{where}.settings")
    if len(settings) != 5:
        raise BrokerStateError(f"{where}.settings: 5 values expected")
    n_records, per_task, epochs, max_retries, seed = (
        _int(v, f"{where}.settings") for v in settings
    )
    if min(n_records, per_task, epochs) < 1:
        raise BrokerStateError(f"{where}.settings: records, per_task and epochs must be >= 1")
    total = -(-n_records // per_task) * epochs

    def task_id(v: object, what: str) -> int:
        t = _int(v, f"{where}.{what}")
        if t >= total:
            raise BrokerStateError(f"{where}.{what}: task {t} of a job of {total} tasks")
        return t

    held = []
    for raw_h in _list(j.get("held"), f"{where}.held"):
        h = _list(raw_h, f"{where}.held")
        if len(h) != 2:
            raise BrokerStateError(f"{where}.held: [task, worker] expected")
        held.append((task_id(h[0], "held"), _str(h[1], f"{where}.held")))
    retries = []
    for raw_r in _list(j.get("retries"), f"{where}.retries"):
        r = _list(raw_r, f"{where}.retries")
        if len(r) != 2:
            raise BrokerStateError(f"{where}.retries: [task, count] expected")
        retries.append((task_id(r[0], "retries"), _int(r[1], f"{where}.retries")))
    done = _from_ranges(j.get("done"), f"{where}.done")
    if done and max(done) >= total:
        raise BrokerStateError(f"{where}.done: task {max(done)} of a job of {total} tasks")
    queue = tuple(task_id(t, "queue") for t in _list(j.get("queue"), f"{where}.queue"))
    places = [*queue, *(t for t, _ in held), *done]
    if len(places) != total or len(set(places)) != total:
        raise BrokerStateError(
            f"{where}: every task must be exactly once queued, held or done "
            f"({len(set(places))} distinct of {total}, {len(places)} places)"
        )
    failed = j.get("failed")
    cancelled = j.get("cancelled", False)  # absent from records older than job control
    if not isinstance(cancelled, bool):
        raise BrokerStateError(f"{where}.cancelled: true or false expected, got {cancelled!r}")
    orphaned = []
    for raw_o in _list(j.get("orphaned", []), f"{where}.orphaned"):
        o = _list(raw_o, f"{where}.orphaned")
        if len(o) != 2:
            raise BrokerStateError(f"{where}.orphaned: [task, worker] expected")
        orphaned.append((_int(o[0], f"{where}.orphaned"), _str(o[1], f"{where}.orphaned")))
    return JobRecord(
        name=_str(j.get("name"), f"{where}.name"),
        n_records=n_records,
        per_task=per_task,
        epochs=epochs,
        max_retries=max_retries,
        seed=seed,
        queue=queue,
        held=tuple(held),
        retries=tuple(retries),
        done=done,
        failed=None if failed is None else _str(failed, f"{where}.failed"),
        cancelled=cancelled,
        orphaned=tuple(orphaned),
    )


def _to_ranges(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids as [start, stop) runs (a finished epoch is one run)."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def _from_ranges(raw: object, what: str) -> tuple[int, ...]:
    out: list[int] = []
    last = -1
    for r in _list(raw, what):
        pair = _list(r, what)
        if len(pair) != 2:
            raise BrokerStateError(f"{what}: [start, stop) runs expected")
        start, stop = _int(pair[0], what), _int(pair[1], what)
        if not last <= start < stop:
            raise BrokerStateError(f"{what}: runs must be ascending and non-empty")
        if stop - start > 1 << 26:
            raise BrokerStateError(f"{what}: a run of {stop - start} tasks is implausible")
        out.extend(range(start, stop))
        last = stop
    return tuple(out)


def _map(v: object, what: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise BrokerStateError(f"{what}: a map expected, got {type(v).__name__}")
    return v


def _list(v: object, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise BrokerStateError(f"{what}: a list expected, got {type(v).__name__}")
    return v


def _int(v: object, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < 2**63:
        raise BrokerStateError(f"{what}: an integer >= {lo} expected, got {v!r}")
    return v


def _str(v: object, what: str) -> str:
    if not isinstance(v, str):
        raise BrokerStateError(f"{what}: a string expected, got {type(v).__name__}")
    return v
