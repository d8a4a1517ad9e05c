"""The typed records of the control messages between shards, clients and the broker
(registration, heartbeats, hellos, status, clock and task calls, assignments, maps), by
the rules of :mod:`zps.protocol.messages`.  Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from zps.errors import ProtocolError
from zps.protocol.enums import Mode, Role, Status
from zps.protocol.fields import (
    Header,
    _bool,
    _field,
    _header,
    _int,
    _label,
    _opt_int,
    _opt_str,
    _role,
    _send_time,
    _str,
)

# -- shard -> broker ---------------------------------------------------------------

#: The bytes of a claim's slot bits at most (2**20 slots).
MAX_SLOT_BYTES = 1 << 17


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
    #: The slots the copy serves, one bit per slot (``numpy.packbits``), and the version
    #: of the map they match: a broker without its record learns the slot map (live
    #: resharding changed it) from them.  Absent: an older shard.
    slots: bytes | None = None
    slot_version: int = 0
    #: The slots a move fences at this copy, and those it imports (same encoding; absent:
    #: none): a broker without its record cancels the move they belong to.
    fenced: bytes | None = None
    importing: bytes | None = None

    @classmethod
    def parse(cls, h: object) -> ShardClaim:
        c = _header(h, "claim")
        bits = {}
        for key in ("slots", "fenced", "importing"):
            v = c.get(key)
            if v is not None and (not isinstance(v, bytes) or len(v) > MAX_SLOT_BYTES):
                raise ProtocolError(f"claim {key} must be bytes, at most {MAX_SLOT_BYTES}")
            bits[key] = v
        slots = bits["slots"]
        return cls(
            partition=_int(_field(c, "partition", "claim"), "claim partition", hi=2**31 - 1),
            epoch=_int(_field(c, "epoch", "claim"), "claim epoch"),
            role=_role(_field(c, "role", "claim"), "claim role"),
            lsn=_opt_int(c, "lsn", "claim lsn", 0),
            in_sync=_bool(c.get("in_sync", False), "claim in_sync"),
            complete=_bool(c.get("complete", True), "claim complete"),
            slots=slots,
            slot_version=_opt_int(c, "slot_version", "claim slot_version", 0),
            fenced=bits["fenced"],
            importing=bits["importing"],
        )

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "partition": self.partition,
            "epoch": self.epoch,
            "role": self.role.value,
            "lsn": self.lsn,
            "in_sync": self.in_sync,
            "complete": self.complete,
        }
        if self.slots is not None:
            wire["slots"] = self.slots
            wire["slot_version"] = self.slot_version
        for key, bits in (("fenced", self.fenced), ("importing", self.importing)):
            if bits is not None:
                wire[key] = bits
        return wire


@dataclass(frozen=True, slots=True)
class ShardRegister:
    """REGISTER, shard -> broker: a shard joins (or re-joins after a broker restart).

    ``address`` is its replication endpoint; ``public_key`` its Z85 CURVE public key
    (40 characters), handed to its replicas, or nil: anything else there is dropped, not
    refused (without CURVE it is never used); ``claim`` what it served before.
    ``host`` and ``zone`` place copies of a partition apart (``zone``: optional rack
    or zone label, at most 100 characters).  ``refused``: the partition and epoch of a
    primary's role this shard refused because it let that partition's data go since it
    last registered (``ShardSession.assign``); nil otherwise.
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
    refused: tuple[int, int] | None = None

    @classmethod
    def parse(cls, h: Header) -> ShardRegister:
        claim = h.get("claim")
        refused = h.get("refused")
        if refused is not None:
            if (
                not isinstance(refused, list | tuple)
                or len(refused) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in refused)
            ):
                raise ProtocolError("REGISTER refused must be [partition, epoch] or nil")
            refused = (refused[0], refused[1])
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
            refused=refused,
        )

    def to_wire(self) -> dict[str, Any]:
        wire = {
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
        if self.refused is not None:  # absent from shards before the field
            wire["refused"] = list(self.refused)
        return wire


@dataclass(frozen=True, slots=True)
class ShardHeartbeat:
    """HEARTBEAT, shard -> broker.

    ``t`` (wire key ``"t"``) is the shard's monotonic send time, echoed back in the
    :class:`LeaseEcho` that renews its lease; it is not a table name.  ``in_sync`` is
    sent by primaries only (the replicas that caught up).  ``durable`` is the LSN its
    write-ahead log holds (nil without a log): what a restart from its data dir
    gets back, which the broker records as the partition's floor.  ``new_link``: the
    heartbeat is the shard's greeting on a data link's connection just made (what a
    broker or router posted by the one before may be lost with it).
    """

    t: float | None = None
    lsn: int = 0
    epoch: int | None = None
    stats: dict[str, Any] | None = None
    in_sync: tuple[str, ...] | None = None
    durable: int | None = None
    new_link: bool = False

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
            new_link=h.get("new_link") is True,
        )

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"t": self.t, "lsn": self.lsn, "epoch": self.epoch, "stats": self.stats}
        if self.in_sync is not None:
            h["in_sync"] = list(self.in_sync)
        if self.durable is not None:
            h["durable"] = self.durable
        if self.new_link:
            h["new_link"] = True
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
    since its previous one.  ``relinked``, broker -> client: the partitions whose
    primary's data link to the broker was made again; what is in flight to them may
    have been lost with the connection before, and is sent again."""

    train: TrainReport | None = None
    relinked: tuple[int, ...] = ()

    @classmethod
    def parse(cls, h: Header) -> Heartbeat:
        train, relinked = h.get("train"), h.get("relinked", [])
        if not isinstance(relinked, list) or not all(type(p) is int for p in relinked):
            raise ProtocolError("HEARTBEAT relinked must be a list of partitions")
        return cls(None if train is None else TrainReport.parse(train), tuple(relinked))

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {} if self.train is None else {"train": self.train.to_wire()}
        if self.relinked:
            h["relinked"] = list(self.relinked)
        return h


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

    @staticmethod
    def refusal(msg: str, **extra: Any) -> dict[str, Any]:
        """The report answering a STATUS request refused whole (a key whose role may not
        give its commands, a malformed request): each command it may carry says why."""
        report: dict[str, Any] = {"st": Status.BAD_REQUEST.value, "msg": msg, **extra}
        for command in ("reset", "drain", "scale"):
            report[command] = {"ok": False, "msg": msg}
        return report

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
    by ``ClusterMap.from_wire`` on arrival.  To shards under CURVE, ``shard_keys``: each
    registered shard's name and the Z85 public key it registered with, so a primary
    takes its replicas' subscriptions from those keys only."""

    map: dict[str, Any]
    shard_keys: dict[str, str] | None = None

    @classmethod
    def parse(cls, h: Header) -> MapUpdate:
        m = _field(h, "map", "MAP")
        if not isinstance(m, dict):
            raise ProtocolError("MAP map must be a map")
        keys = h.get("shard_keys")
        if keys is not None and not (
            isinstance(keys, dict)
            and all(isinstance(n, str) and isinstance(k, str) for n, k in keys.items())
        ):
            raise ProtocolError("MAP shard_keys must map shard names to keys")
        return cls(m, keys)

    def to_wire(self) -> dict[str, Any]:
        if self.shard_keys:
            return {"map": self.map, "shard_keys": self.shard_keys}
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
