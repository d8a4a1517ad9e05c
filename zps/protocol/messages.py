"""Typed records of the control messages, and the enums the roles share.

One job: turn a decoded header into a typed record, or raise :class:`ProtocolError`
(and nothing else), so a driver never indexes an untyped dict.

Rules:

1. ``Record.parse(header)`` checks every field it reads, type and range, and raises
   only :class:`ProtocolError`; keys it does not know are ignored (a newer peer may
   send more).  A missing optional field takes its documented default.
2. ``record.to_wire()`` builds the header a sender puts on the wire, with the same
   keys the readers expect, so ``Record.parse(record.to_wire()) == record``.
3. The wire keys are fixed by the peers that already speak them: ``"t"`` is the
   heartbeat's send time here (:class:`ShardHeartbeat`, :class:`LeaseEcho`), while in a
   data request's ops it names a table.  The records keep both meanings apart.

This module does no I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias

from zps.errors import ProtocolError

Header: TypeAlias = Mapping[str, Any]


class Mode(enum.StrEnum):
    """A training job's consistency mode."""

    ASYNC = "async"
    SYNC = "sync"
    SSP = "ssp"


class Role(enum.StrEnum):
    """What a shard does for a partition."""

    PRIMARY = "primary"
    REPLICA = "replica"
    SPARE = "spare"


class Status(enum.StrEnum):
    """The status code of a reply (its ``"st"``); errors carry a ``"msg"`` too."""

    OK = "OK"
    BAD_REQUEST = "BAD_REQUEST"
    UNKNOWN_TABLE = "UNKNOWN_TABLE"
    SHAPE_MISMATCH = "SHAPE_MISMATCH"
    TABLE_CONFLICT = "TABLE_CONFLICT"
    SHARD_UNAVAILABLE = "SHARD_UNAVAILABLE"
    NOT_PRIMARY = "NOT_PRIMARY"
    STALE_EPOCH = "STALE_EPOCH"
    INTERNAL = "INTERNAL"
    JOB_FAILED = "JOB_FAILED"
    #: The broker could not pass the request on (its shard's queue is full); retry later.
    OVERLOADED = "OVERLOADED"
    #: acks="all": fewer copies of the partition are in sync than ``min_in_sync``.
    NOT_ENOUGH_REPLICAS = "NOT_ENOUGH_REPLICAS"
    #: The message's route frame has another protocol version (the reply has this one).
    VERSION_MISMATCH = "VERSION_MISMATCH"
    #: A standby broker of a pair: ask the other one (clients switch and retry).
    PASSIVE = "PASSIVE"
    #: Live resharding: the partition no longer holds some slots of the request (not
    #: applied); the client splits the call again by its newer map.
    MOVED = "MOVED"


# -- field readers: each returns a checked value or raises ProtocolError ----------


def _field(h: Header, key: str, what: str) -> Any:
    if key not in h:
        raise ProtocolError(f"{what}: missing {key!r}")
    return h[key]


def _int(value: object, what: str, *, lo: int = 0, hi: int = 2**64 - 1) -> int:
    # bool is an int subclass; on the wire it is not a number
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _str(value: object, what: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ProtocolError(f"{what} must be a {'' if empty else 'non-empty '}string")
    return value


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{what} must be true or false, got {value!r}")
    return value


def _opt_int(h: Header, key: str, what: str, default: int) -> int:
    return _int(h[key], what) if key in h else default


def _opt_str(h: Header, key: str, what: str, default: str) -> str:
    return _str(h[key], what) if key in h else default


def _label(h: Header, key: str, what: str) -> str:
    value = _opt_str(h, key, what, "")
    if len(value) > 100:
        raise ProtocolError(f"{what} must be at most 100 characters")
    return value


def _header(h: object, what: str) -> Header:
    if not isinstance(h, Mapping):
        raise ProtocolError(f"{what} header must be a map, got {type(h).__name__}")
    return h


def _send_time(value: object) -> float | None:
    # A heartbeat's "t": the sender's monotonic clock (a float), not a table name.
    if value is not None and (not isinstance(value, float) or not math.isfinite(value)):
        raise ProtocolError(f"HEARTBEAT t must be a finite float send time, got {value!r}")
    return value


def _role(value: object, what: str) -> Role:
    if not isinstance(value, str) or value not in Role.__members__.values():
        raise ProtocolError(f"{what} must be one of {[r.value for r in Role]}, got {value!r}")
    return Role(value)


# -- shard -> broker ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardClaim:
    """What a (re)registering shard says it already serves (``REGISTER["claim"]``)."""

    partition: int
    epoch: int
    role: Role
    lsn: int = 0
    in_sync: bool = False
    #: False when the copy may lack writes it acknowledged: restored from a checkpoint
    #: with no log after it (``durability="none"``) other than one written at shutdown.
    complete: bool = True

    @classmethod
    def parse(cls, h: object) -> ShardClaim:
        c = _header(h, "claim")
        return cls(
            partition=_int(_field(c, "partition", "claim"), "claim partition", hi=2**31 - 1),
            epoch=_int(_field(c, "epoch", "claim"), "claim epoch"),
            role=_role(_field(c, "role", "claim"), "claim role"),
            lsn=_opt_int(c, "lsn", "claim lsn", 0),
            in_sync=_bool(c.get("in_sync", False), "claim in_sync"),
            complete=_bool(c.get("complete", True), "claim complete"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "epoch": self.epoch,
            "role": self.role.value,
            "lsn": self.lsn,
            "in_sync": self.in_sync,
            "complete": self.complete,
        }


@dataclass(frozen=True, slots=True)
class ShardRegister:
    """REGISTER, shard -> broker: a shard joins (or re-joins after a broker restart).

    ``address`` is its replication endpoint; ``public_key`` its Z85 CURVE public key
    (40 characters), handed to its replicas, or nil: anything else there is dropped, not
    refused (without CURVE it is never used); ``claim`` what it served before.
    ``host`` and ``zone`` place copies of a partition apart (``zone``: optional rack
    or zone label, at most 100 characters).
    """

    MTYPE: ClassVar[str] = "REGISTER"
    host: str = "?"
    pid: int = 0
    address: str = ""
    claim: ShardClaim | None = None
    lsn: int = 0
    public_key: str | None = None
    zone: str = ""
    #: The shard's zps release (shown by ``zps-server status``); "" from older shards.
    version: str = ""
    #: Tells a restarted shard from the earlier process of the same name ("": unknown).
    incarnation: str = ""

    @classmethod
    def parse(cls, h: Header) -> ShardRegister:
        claim = h.get("claim")
        key = h.get("public_key")
        if not isinstance(key, str) or len(key) != 40:
            key = None  # not a Z85 key: the broker only hands keys on, so it drops this one
        return cls(
            host=_opt_str(h, "host", "REGISTER host", "?"),
            pid=_opt_int(h, "pid", "REGISTER pid", 0),
            address=_opt_str(h, "address", "REGISTER address", ""),
            claim=None if claim is None else ShardClaim.parse(claim),
            lsn=_opt_int(h, "lsn", "REGISTER lsn", 0),
            public_key=key,
            zone=_label(h, "zone", "REGISTER zone"),
            version=_opt_str(h, "version", "REGISTER version", ""),
            incarnation=_opt_str(h, "incarnation", "REGISTER incarnation", ""),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "pid": self.pid,
            "address": self.address,
            "claim": self.claim.to_wire() if self.claim else None,
            "lsn": self.lsn,
            "public_key": self.public_key,
            "zone": self.zone,
            "version": self.version,
            "incarnation": self.incarnation,
        }


@dataclass(frozen=True, slots=True)
class ShardHeartbeat:
    """HEARTBEAT, shard -> broker.

    ``t`` (wire key ``"t"``) is the shard's monotonic send time, echoed back in the
    :class:`LeaseEcho` that renews its lease; it is not a table name.  ``in_sync`` is
    sent by primaries only (the replicas that caught up).  ``durable`` is the LSN its
    write-ahead log holds (nil without a log): what a restart from its data dir
    gets back, which the broker records as the partition's floor.
    """

    t: float | None = None
    lsn: int = 0
    epoch: int | None = None
    stats: dict[str, Any] | None = None
    in_sync: tuple[str, ...] | None = None
    durable: int | None = None

    @classmethod
    def parse(cls, h: Header) -> ShardHeartbeat:
        t, epoch, stats, in_sync = h.get("t"), h.get("epoch"), h.get("stats"), h.get("in_sync")
        if stats is not None and not isinstance(stats, dict):
            raise ProtocolError("HEARTBEAT stats must be a map")
        if in_sync is not None and (
            not isinstance(in_sync, list) or not all(isinstance(r, str) for r in in_sync)
        ):
            raise ProtocolError("HEARTBEAT in_sync must be a list of node names")
        return cls(
            t=_send_time(t),
            lsn=_opt_int(h, "lsn", "HEARTBEAT lsn", 0),
            epoch=None if epoch is None else _int(epoch, "HEARTBEAT epoch"),
            stats=stats,
            in_sync=None if in_sync is None else tuple(in_sync),
            durable=None if h.get("durable") is None else _int(h["durable"], "HEARTBEAT durable"),
        )

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"t": self.t, "lsn": self.lsn, "epoch": self.epoch, "stats": self.stats}
        if self.in_sync is not None:
            h["in_sync"] = list(self.in_sync)
        if self.durable is not None:
            h["durable"] = self.durable
        return h


# -- client -> broker --------------------------------------------------------------


#: The name an operator's command (``zps-server status``, ``drain``, ...) gives its client.
ADMIN_CLIENT_PREFIX = "zps-server "


@dataclass(frozen=True, slots=True)
class ClientHello:
    """HELLO, client -> broker: join and ask for the cluster map."""

    host: str = "?"
    pid: int = 0
    name: str = ""
    #: The client's zps release (shown by ``zps-server status``); "" from older clients.
    version: str = ""
    #: A routing broker's endpoint (``zps-server broker --follow``): it announces itself
    #: to be listed in the map; "" for a client.
    router: str = ""

    @classmethod
    def parse(cls, h: Header) -> ClientHello:
        return cls(
            host=_opt_str(h, "host", "HELLO host", "?"),
            pid=_opt_int(h, "pid", "HELLO pid", 0),
            name=_opt_str(h, "name", "HELLO name", ""),
            version=_opt_str(h, "version", "HELLO version", ""),
            router=_opt_str(h, "router", "HELLO router", ""),
        )

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "host": self.host,
            "pid": self.pid,
            "name": self.name,
            "version": self.version,
        }
        if self.router:
            out["router"] = self.router
        return out


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolError(f"{what} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class TrainReport:
    """What a worker's ``ps.report`` calls recorded since its previous heartbeat, for
    the job it trains (the job of its last task, else the last it created): ``rows``
    trained in ``secs`` seconds over ``steps`` reports, ``loss`` their mean (None if
    none gave one)."""

    job: str
    rows: float
    secs: float
    steps: int
    loss: float | None = None

    @classmethod
    def parse(cls, h: object) -> TrainReport:
        h = _header(h, "HEARTBEAT train")
        rows = _number(_field(h, "rows", "HEARTBEAT train"), "HEARTBEAT train rows")
        secs = _number(_field(h, "secs", "HEARTBEAT train"), "HEARTBEAT train secs")
        if rows < 0 or secs < 0:
            raise ProtocolError("HEARTBEAT train rows and secs must be >= 0")
        loss = h.get("loss")
        return cls(
            job=_str(_field(h, "job", "HEARTBEAT train"), "HEARTBEAT train job", empty=False),
            rows=rows,
            secs=secs,
            steps=_int(_field(h, "steps", "HEARTBEAT train"), "HEARTBEAT train steps"),
            loss=None if loss is None else _number(loss, "HEARTBEAT train loss"),
        )

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"job": self.job, "rows": self.rows, "secs": self.secs}
        h["steps"] = self.steps
        if self.loss is not None:
            h["loss"] = self.loss
        return h


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """HEARTBEAT: client -> broker, and the broker's probes (empty).  A training
    client's carries ``train`` (a :class:`TrainReport`) when ``ps.report`` was called
    since its previous one."""

    train: TrainReport | None = None

    @classmethod
    def parse(cls, h: Header) -> Heartbeat:
        train = h.get("train")
        return cls(None if train is None else TrainReport.parse(train))

    def to_wire(self) -> dict[str, Any]:
        return {} if self.train is None else {"train": self.train.to_wire()}


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """STATUS, client -> broker: ask for the status report (answered with STATUS).

    With ``reset_partition`` it is an operator's command first: give that lost
    partition to its newest surviving copy (or an empty shard), accepting the loss
    of the writes the missing copies held; ``accept_data_loss`` must be true.  The
    report then carries ``reset`` (``{"ok": bool, "msg": str}``).
    """

    reset_partition: int | None = None
    accept_data_loss: bool = False
    #: An operator's drain (or undrain) of the shard of that node id; the report then
    #: carries ``drain`` (``{"ok": bool, "msg": str}``).
    drain: str | None = None
    undrain: str | None = None
    #: Live resharding: ``zps-server scale --partitions N`` (the report then carries
    #: ``scale``, ``{"ok": bool, "msg": str}``), or ``--cancel``.
    scale: int | None = None
    scale_cancel: bool = False
    #: Optional tuning of a scale: slots per move, bytes per copied piece (0: default).
    scale_max_slots: int = 0
    scale_piece_bytes: int = 0

    @classmethod
    def parse(cls, h: Header) -> StatusRequest:
        reset, drain, undrain = h.get("reset_partition"), h.get("drain"), h.get("undrain")
        scale = h.get("scale")
        return cls(
            scale=None if scale is None else _int(scale, "STATUS scale", hi=2**20),
            scale_cancel=_bool(h.get("scale_cancel", False), "STATUS scale_cancel"),
            scale_max_slots=_int(h.get("scale_max_slots", 0), "STATUS scale_max_slots", hi=2**20),
            scale_piece_bytes=_int(
                h.get("scale_piece_bytes", 0), "STATUS scale_piece_bytes", hi=2**30
            ),
            reset_partition=None
            if reset is None
            else _int(reset, "STATUS reset_partition", hi=2**31 - 1),
            accept_data_loss=_bool(h.get("accept_data_loss", False), "STATUS accept_data_loss"),
            drain=None if drain is None else _str(drain, "STATUS drain", empty=False)[:100],
            undrain=None if undrain is None else _str(undrain, "STATUS undrain", empty=False)[:100],
        )

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {}
        if self.reset_partition is not None:
            h["reset_partition"] = self.reset_partition
            h["accept_data_loss"] = self.accept_data_loss
        if self.drain is not None:
            h["drain"] = self.drain
        if self.undrain is not None:
            h["undrain"] = self.undrain
        if self.scale is not None:
            h["scale"] = self.scale
        if self.scale_cancel:
            h["scale_cancel"] = True
        if self.scale_max_slots:
            h["scale_max_slots"] = self.scale_max_slots
        if self.scale_piece_bytes:
            h["scale_piece_bytes"] = self.scale_piece_bytes
        return h


@dataclass(frozen=True, slots=True)
class Bye:
    """BYE: an orderly departure (from a client or a shard).  ``msg`` says why, when a
    primary refuses a subscription with it."""

    msg: str = ""

    @classmethod
    def parse(cls, h: Header) -> Bye:
        msg = h.get("msg", "")
        return cls(msg if isinstance(msg, str) else "")  # only ever logged

    def to_wire(self) -> dict[str, Any]:
        return {"msg": self.msg} if self.msg else {}


ClockOp = Literal["join", "tick", "leave"]


@dataclass(frozen=True, slots=True)
class ClockRequest:
    """CLOCK, client -> broker: ``join``, ``tick`` (with ``finished``, the steps done)
    or ``leave`` the step clock of sync and ssp training; ``tau`` is the staleness."""

    op: ClockOp
    mode: Mode = Mode.ASYNC
    tau: int = 0
    finished: int | None = None

    @classmethod
    def parse(cls, h: Header) -> ClockRequest:
        op, mode = h.get("op"), h.get("mode", "async")
        if op not in ("join", "tick", "leave"):
            raise ProtocolError(f"unknown clock operation {op!r}")
        if not isinstance(mode, str) or mode not in Mode.__members__.values():
            raise ProtocolError(f"{mode!r} is not a valid training mode")
        tau = h.get("tau", 0)
        if type(tau) is not int or tau < 0:
            raise ProtocolError(f"staleness must be an integer >= 0, got {tau!r}")
        finished = h.get("finished")
        if op == "tick" and (type(finished) is not int or finished < 0):
            raise ProtocolError("tick needs 'finished', a step count")
        return cls(op, Mode(mode), tau, finished if op == "tick" else None)

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"op": self.op, "mode": self.mode.value, "tau": self.tau}
        if self.finished is not None:
            h["finished"] = self.finished
        return h


@dataclass(frozen=True, slots=True)
class JobSettings:
    """How a data-task job cuts its records (``TASK create``)."""

    n_records: int = 0
    per_task: int = 0
    epochs: int = 1
    max_retries: int = 3
    seed: int = 0

    def astuple(self) -> tuple[int, int, int, int, int]:
        return (self.n_records, self.per_task, self.epochs, self.max_retries, self.seed)


_JOB_KEYS = ("n_records", "per_task", "epochs", "max_retries", "seed")

TaskOp = Literal["create", "next", "done", "release", "list", "show", "cancel", "reset"]

#: Job control that changes a job: an operator's (with CURVE key roles on, the operator
#: key's).  A ``create`` that asks for a restart is one too (:attr:`TaskRequest.operator_only`).
OPERATOR_TASK_OPS: frozenset[str] = frozenset({"cancel", "reset"})


@dataclass(frozen=True, slots=True)
class TaskRequest:
    """TASK, client -> broker, on the job named ``job``:

    * ``create`` with :class:`JobSettings` (idempotent for the same settings; the reply's
      ``progress`` has the job's ``state``); ``restart`` runs a finished job again;
    * ``next``: the next task; ``wait=False`` answers at once (``pending`` if none is
      free yet), otherwise the answer waits for one;
    * ``done`` / ``release`` of ``task`` (a task id);
    * ``list`` (every job's progress; ``job`` may be empty), ``show`` (one job's);
    * ``cancel``, ``reset``: job control (see :data:`OPERATOR_TASK_OPS`).
    """

    op: TaskOp
    job: str
    settings: JobSettings | None = None
    wait: bool = True
    task: int | None = None
    restart: bool = False

    @property
    def operator_only(self) -> bool:
        """Whether this request changes a job as only an operator may."""
        return self.op in OPERATOR_TASK_OPS or (self.op == "create" and self.restart)

    @classmethod
    def parse(cls, h: Header) -> TaskRequest:
        op, job = h.get("op"), h.get("job", "")
        if op == "list" and job == "":
            return cls("list", "")
        if not isinstance(job, str) or not job:
            raise ProtocolError("a task request needs a job name")
        match op:
            case "create":
                values = [
                    h.get(k, d) for k, d in zip(_JOB_KEYS, JobSettings().astuple(), strict=True)
                ]
                if not all(type(v) is int for v in values):
                    raise ProtocolError("job settings must be integers")
                restart = _bool(h.get("restart", False), "TASK restart")
                return cls("create", job, settings=JobSettings(*values), restart=restart)
            case "list" | "show" | "cancel" | "reset":
                return cls(op, job)
            case "next":
                return cls("next", job, wait=_bool(h.get("wait", True), "TASK wait"))
            case "done" | "release":
                task = h.get("task")
                if type(task) is not int:
                    raise ProtocolError(f"{op} needs 'task', a task id")
                return cls(op, job, task=task)
            case _:
                raise ProtocolError(f"unknown task operation {op!r}")

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"op": self.op, "job": self.job}
        if self.settings is not None:
            h.update(zip(_JOB_KEYS, self.settings.astuple(), strict=True))
        if self.op == "next" and not self.wait:
            h["wait"] = False
        if self.task is not None:
            h["task"] = self.task
        if self.restart:
            h["restart"] = True
        return h


# -- broker -> shard / client -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assign:
    """ASSIGN, broker -> shard: the role it holds for ``partition`` (nil for a spare) at
    ``epoch``; a replica follows ``primary`` at ``primary_address`` (CURVE key
    ``primary_key``, empty without CURVE)."""

    role: Role
    partition: int | None
    epoch: int
    primary: str | None = None
    primary_address: str = ""
    primary_key: str = ""
    n_partitions: int = 0

    @classmethod
    def parse(cls, h: Header) -> Assign:
        partition, primary, address = h.get("partition"), h.get("primary"), h.get("primary_address")
        return cls(
            role=_role(_field(h, "role", "ASSIGN"), "ASSIGN role"),
            partition=None if partition is None else _int(partition, "ASSIGN partition"),
            epoch=_opt_int(h, "epoch", "ASSIGN epoch", 0),
            primary=None if primary is None else _str(primary, "ASSIGN primary"),
            primary_address="" if address is None else _str(address, "ASSIGN address"),
            primary_key=_opt_str(h, "primary_key", "ASSIGN primary_key", ""),
            n_partitions=_opt_int(h, "n_partitions", "ASSIGN n_partitions", 0),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "role": self.role.value,
            "partition": self.partition,
            "epoch": self.epoch,
            "primary": self.primary,
            "primary_address": self.primary_address,
            "primary_key": self.primary_key,
            "n_partitions": self.n_partitions,
        }


@dataclass(frozen=True, slots=True)
class LeaseEcho:
    """HEARTBEAT, broker -> shard: the answer to a :class:`ShardHeartbeat`, echoing its
    send time ``t`` (wire key ``"t"``) with the role the broker holds for the shard; it
    renews the lease of exactly that role."""

    t: float | None
    role: Role
    partition: int | None
    epoch: int

    @classmethod
    def parse(cls, h: Header) -> LeaseEcho:
        partition = h.get("partition")
        return cls(
            t=_send_time(h.get("t")),
            role=_role(_field(h, "role", "HEARTBEAT echo"), "HEARTBEAT role"),
            partition=None if partition is None else _int(partition, "HEARTBEAT partition"),
            epoch=_opt_int(h, "epoch", "HEARTBEAT epoch", 0),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "role": self.role.value,
            "partition": self.partition,
            "epoch": self.epoch,
        }


@dataclass(frozen=True, slots=True)
class MapUpdate:
    """MAP, broker -> client/shard: the cluster map (``ClusterMap.to_wire()``), checked
    by ``ClusterMap.from_wire`` on arrival."""

    map: dict[str, Any]

    @classmethod
    def parse(cls, h: Header) -> MapUpdate:
        m = _field(h, "map", "MAP")
        if not isinstance(m, dict):
            raise ProtocolError("MAP map must be a map")
        return cls(m)

    def to_wire(self) -> dict[str, Any]:
        return {"map": self.map}


@dataclass(frozen=True, slots=True)
class StatusReply:
    """A reply that carries only its status ``st`` and a ``msg`` (an error's, or empty)."""

    status: Status
    msg: str = ""

    @classmethod
    def parse(cls, h: Header) -> StatusReply:
        st = h.get("st")
        if not isinstance(st, str) or st not in Status.__members__.values():
            raise ProtocolError(f"unknown reply status {st!r}")
        return cls(Status(st), _opt_str(h, "msg", "reply msg", ""))

    def to_wire(self) -> dict[str, Any]:
        return {"st": self.status.value, "msg": self.msg}


@dataclass(frozen=True, slots=True)
class RegisterAgain:
    """REGISTER, broker -> shard: the broker does not know this shard (it restarted);
    the shard registers again.  Its header carries nothing the receiver reads."""

    @classmethod
    def parse(cls, h: Header) -> RegisterAgain:
        return cls()

    def to_wire(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True, slots=True)
class HelloAgain:
    """HELLO, broker -> client: the broker does not know this client (it restarted);
    the client introduces itself again.  Its header carries nothing the receiver reads."""

    @classmethod
    def parse(cls, h: Header) -> HelloAgain:
        return cls()

    def to_wire(self) -> dict[str, Any]:
        return {}


# -- replication, replica <-> primary ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Subscribe:
    """SUBSCRIBE, replica -> primary: send me ``partition`` at ``epoch`` (a snapshot, then
    the stream).  ``abandoned`` names a snapshot transfer the replica gave up, to be
    replaced by a new one.  ``host``: the replica's shared-memory host key
    (:func:`zps.shm.host_key`), when it reads large stream frames from the primary's
    shared memory; absent, every frame comes inline."""

    partition: int | None
    epoch: int
    abandoned: int | None = None
    host: str | None = None

    @classmethod
    def parse(cls, h: Header) -> Subscribe:
        partition, abandoned, host = h.get("partition"), h.get("abandoned"), h.get("host")
        if host is not None and (not isinstance(host, str) or len(host) > 256):
            raise ProtocolError("SUBSCRIBE host must be a string of at most 256 characters")
        return cls(
            partition=None if partition is None else _int(partition, "SUBSCRIBE partition"),
            epoch=_int(_field(h, "epoch", "SUBSCRIBE"), "SUBSCRIBE epoch"),
            abandoned=None if abandoned is None else _int(abandoned, "SUBSCRIBE abandoned"),
            host=host,
        )

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"partition": self.partition, "epoch": self.epoch}
        if self.abandoned is not None:
            h["abandoned"] = self.abandoned
        if self.host is not None:
            h["host"] = self.host
        return h


@dataclass(frozen=True, slots=True)
class StreamAck:
    """ACK, replica -> primary: everything up to ``lsn`` is applied, at ``epoch``, on top
    of the snapshot at LSN ``base`` (-1: none loaded; nil from a peer that names none)."""

    lsn: int
    epoch: int
    base: int | None = None

    @classmethod
    def parse(cls, h: Header) -> StreamAck:
        base = h.get("base")
        return cls(
            lsn=_int(_field(h, "lsn", "ACK"), "ACK lsn"),
            epoch=_int(_field(h, "epoch", "ACK"), "ACK epoch"),
            base=None if base is None else _int(base, "ACK base", lo=-1),
        )

    def to_wire(self) -> dict[str, Any]:
        return {"lsn": self.lsn, "epoch": self.epoch, "base": self.base}


@dataclass(frozen=True, slots=True)
class Replicate:
    """REPLICATE's header, primary -> replica: the request that follows (its header and
    payload frames as the client sent them) took the partition from LSN ``prev`` to
    ``lsn``; the epoch travels in the route.  ``checked``: every operation of it
    succeeded on the primary (its gradients are finite: a replica skips that check)."""

    prev: int
    lsn: int
    checked: bool = False

    @classmethod
    def parse(cls, h: Header) -> Replicate:
        return cls(
            prev=_int(_field(h, "prev", "REPLICATE"), "REPLICATE prev"),
            lsn=_int(_field(h, "lsn", "REPLICATE"), "REPLICATE lsn"),
            checked=h.get("ok") is True,
        )

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"prev": self.prev, "lsn": self.lsn}
        if self.checked:
            wire["ok"] = True
        return wire


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    """SNAPSHOT_CHUNK's header, primary -> replica: chunk ``seq`` of the ``count`` chunks
    of snapshot ``id``, ``total`` bytes at LSN ``lsn`` cut into chunks of ``chunk``
    bytes; the payload frames carry the chunk's bytes.  Whether the sizes agree is the
    assembly's to check (:class:`~zps.store.snapshot.ChunkAssembly`)."""

    id: int
    seq: int
    count: int
    total: int
    chunk: int
    lsn: int

    @classmethod
    def parse(cls, h: Header) -> SnapshotChunk:
        def need(key: str) -> int:
            return _int(_field(h, key, "SNAPSHOT_CHUNK"), f"SNAPSHOT_CHUNK {key}")

        return cls(
            id=need("id"),
            seq=need("seq"),
            count=need("count"),
            total=need("total"),
            chunk=need("chunk"),
            lsn=need("lsn"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "seq": self.seq,
            "count": self.count,
            "total": self.total,
            "chunk": self.chunk,
            "lsn": self.lsn,
        }


@dataclass(frozen=True, slots=True)
class SnapshotAck:
    """SNAPSHOT_ACK, replica -> primary: chunk ``seq`` of snapshot ``id`` arrived."""

    id: int
    seq: int

    @classmethod
    def parse(cls, h: Header) -> SnapshotAck:
        return cls(
            id=_int(_field(h, "id", "SNAPSHOT_ACK"), "SNAPSHOT_ACK id"),
            seq=_int(_field(h, "seq", "SNAPSHOT_ACK"), "SNAPSHOT_ACK seq"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "seq": self.seq}


#: What the broker accepts as control messages, from shards and from clients.
ShardControl: TypeAlias = ShardRegister | ShardHeartbeat | Bye
ClientControl: TypeAlias = (
    ClientHello | Heartbeat | StatusRequest | ClockRequest | TaskRequest | Bye
)
#: What a shard accepts from the broker as control messages.
BrokerToShard: TypeAlias = Assign | MapUpdate | LeaseEcho | Heartbeat | RegisterAgain
#: What a client accepts from the broker besides replies.
BrokerToClient: TypeAlias = MapUpdate | HelloAgain | Heartbeat
#: What a primary accepts from its replicas.
FromReplica: TypeAlias = Subscribe | StreamAck | SnapshotAck
