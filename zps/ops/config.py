"""Settings of each process, as frozen dataclasses parsed once and passed down.

Sources, strongest first: command-line flags, then the TOML file
(``/etc/zps/zps.toml`` unless ``--config`` names another), then the defaults
below.  Nothing else in zps reads the environment or files for settings; the
CLI builds these and hands them to the drivers.

Every value is checked when its dataclass is built, and the TOML loader
refuses unknown sections and keys, so a typo is an error naming the key
(``zps.toml: unknown key 'broker.partitons'``), never a silently ignored
setting.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from zps.core.routing import DEFAULT_SLOTS
from zps.errors import ConfigError
from zps.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, MESSAGE_BUDGET

DEFAULT_BROKER = "tcp://127.0.0.1:5555"
#: What a shard name may be (``--name``, ``[shard] name``).
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,59}")
DEFAULT_BIND = "tcp://*:5555"
DEFAULT_CONFIG_PATH = "/etc/zps/zps.toml"

T = TypeVar("T")


def _positive(owner: str, **values: object) -> None:
    for key, value in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ConfigError(f"{owner}.{key} must be a positive number, got {value!r}")


def _integer(owner: str, minimum: int, **values: object) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{owner}.{key} must be an integer >= {minimum}, got {value!r}")


def _endpoint(owner: str, key: str, value: object) -> None:
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(
            f"{owner}.{key} must be a ZeroMQ endpoint like tcp://HOST:PORT, got {value!r}"
        )


def given_brokers(role: str, brokers: tuple[str, ...], broker: str) -> tuple[object, str]:
    """What a role's settings give as its brokers, and the key that gives it (``brokers``
    when set, else ``broker``), for :func:`broker_endpoints` to check and to name."""
    return (list(brokers), f"{role}.brokers") if brokers else (broker, f"{role}.broker")


def broker_endpoints(value: object, owner: str = "broker") -> tuple[str, ...]:
    """The broker endpoints a process is given: one endpoint, a comma-separated pair
    (``tcp://a:5555,tcp://b:5555``), or a list of them (a Binary Star pair)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ConfigError(f"{owner} must be an endpoint or a list of them, got {value!r}")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{owner} must be an endpoint or a list of them, got {value!r}")
        for part in (p.strip() for p in item.split(",")):
            if "://" not in part:
                raise ConfigError(
                    f"{owner} must be ZeroMQ endpoints like tcp://HOST:PORT, got {part!r}"
                )
            out.append(part)
    if not 1 <= len(out) <= 2:
        raise ConfigError(
            f"{owner}: give one broker endpoint or a pair of them, got {len(out)}: {value!r}"
        )
    if len(set(out)) != len(out):
        raise ConfigError(f"{owner}: the same broker endpoint is given twice: {value!r}")
    return tuple(out)


@dataclass(frozen=True)
class Heartbeat:
    """A peer silent for ``interval * liveness`` seconds is declared dead."""

    interval: float = 0.2
    liveness: int = 5
    #: A shard's heartbeats go on while its event loop is busy with one long step (a
    #: table outgrowing its arrays) for up to this many seconds; a loop busy for
    #: longer is taken for stuck, and the shard fails over (see zps.shard.liveness).
    #: Below the shard unit's WatchdogSec (10 s), which kills a loop held longer.
    max_loop_stall: float = 8.0

    def __post_init__(self) -> None:
        _positive("heartbeat", interval=self.interval, max_loop_stall=self.max_loop_stall)
        _integer("heartbeat", 1, liveness=self.liveness)


@dataclass(frozen=True)
class Security:
    """CURVE keys.  With none configured, traffic is plain (fine on loopback)."""

    #: This process's key pair (``zps-server keygen`` writes them).
    curve_secret_key_file: str | None = None
    curve_public_key_file: str | None = None
    #: For shards and clients: the broker's public key.
    broker_public_key_file: str | None = None
    #: For the broker (and shards' replication endpoints): a directory of
    #: ``*.key`` public keys allowed to connect.
    allowed_clients_dir: str | None = None
    #: Roles: a directory of the shards' public keys.  When set, only these keys may
    #: act as shards (and reach a shard's replication endpoint), the keys of
    #: ``allowed_clients_dir`` only as clients.  Under CURVE, set or not, each
    #: sender's identity is bound to its key (docs/deploy.md, "Security").
    allowed_shards_dir: str | None = None
    #: Roles: a directory of the operators' public keys.  Under CURVE only these keys
    #: may change the cluster rather than a table's values (drain, undrain, scale,
    #: reset-partition, a checkpoint, dropping a table, cancelling, resetting or
    #: restarting a job); they are admitted at the broker as clients too.  Unset: no
    #: key may.
    allowed_operators_dir: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"security.{f.name} must be a path, got {value!r}")
        if (self.curve_secret_key_file is None) != (self.curve_public_key_file is None):
            raise ConfigError(
                "security.curve_secret_key_file and security.curve_public_key_file go together"
            )

    @property
    def enabled(self) -> bool:
        return self.curve_secret_key_file is not None


@dataclass(frozen=True)
class Checkpoint:
    """When a shard writes its partition to ``data_dir`` (it also does on SIGTERM)."""

    #: Seconds between checkpoints (0: only on shutdown) ...
    interval_s: float = 60.0
    #: ... or after this many updates, whichever comes first (0: off).
    every_updates: int = 0
    #: Checkpoints kept per partition; older ones are deleted.
    keep: int = 3

    def __post_init__(self) -> None:
        if (
            isinstance(self.interval_s, bool)
            or not isinstance(self.interval_s, int | float)
            or not 0 <= self.interval_s < math.inf
        ):
            raise ConfigError(
                f"checkpoint.interval_s must be seconds >= 0, got {self.interval_s!r}"
            )
        _integer("checkpoint", 0, every_updates=self.every_updates)
        _integer("checkpoint", 1, keep=self.keep)


@dataclass(frozen=True)
class Replication:
    """How a primary treats its replicas (every shard of a cluster needs the same values)."""

    #: Copies (the primary included) that must hold a write before an ``acks="all"``
    #: write is acknowledged, capped at the copies the broker gives the partition;
    #: with fewer in sync such writes get NOT_ENOUGH_REPLICAS.  1: acks="all" becomes
    #: acks=1 whenever no replica is in sync.
    min_in_sync: int = 2
    #: While a copy that replaces a lost one loads its snapshot, ``acks="all"`` writes
    #: need only the copies in sync (the primary's own write-ahead log holds them),
    #: so a failover stalls writes no longer for a large partition than for a small
    #: one.  Needs a log (a data dir, durability other than "none"); false: writes
    #: wait for ``min_in_sync`` copies even then.
    write_while_repairing: bool = True
    #: Bytes of the stream held for one replica that reads slower than it is sent;
    #: past it the replica is dropped from the in-sync set and must resynchronise.
    follower_queue_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        _integer("replication", 1, min_in_sync=self.min_in_sync)
        if not isinstance(self.write_while_repairing, bool):
            raise ConfigError(
                "replication.write_while_repairing must be true or false, got "
                f"{self.write_while_repairing!r}"
            )
        _integer("replication", 1, follower_queue_bytes=self.follower_queue_bytes)


@dataclass(frozen=True)
class Metrics:
    """The Prometheus endpoint (port 0: none)."""

    port: int = 0
    #: Loopback unless configured: a scrape from another host needs ``host = "0.0.0.0"``
    #: (or the address of the interface Prometheus reaches).
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _integer("metrics", 0, port=self.port)
        if self.port > 65535:
            raise ConfigError(f"metrics.port must be <= 65535, got {self.port}")


@dataclass(frozen=True)
class Limits:
    """Per-request limits a shard enforces (larger requests get BAD_REQUEST), and
    the bytes it keeps between requests, per partition.  Every shard of a cluster
    needs the same values: a replica re-runs its primary's requests."""

    max_ops: int = 4096
    max_ids: int = 8 << 20
    max_array_bytes: int = 512 << 20
    #: The dedup record (replies to recent messages, so a re-sent one is applied once).
    dedup_bytes: int = 64 << 20
    #: Sync mode: pushes are taken for at most this many steps past the committed one.
    step_window: int = 8
    #: Sync mode: gradients buffered until their step commits (past it: OVERLOADED).
    step_buffer_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        _integer(
            "limits",
            1,
            max_ops=self.max_ops,
            max_ids=self.max_ids,
            max_array_bytes=self.max_array_bytes,
            dedup_bytes=self.dedup_bytes,
            step_window=self.step_window,
            step_buffer_bytes=self.step_buffer_bytes,
        )


@dataclass(frozen=True)
class BrokerConfig:
    bind: str = DEFAULT_BIND
    partitions: int = 2
    #: Copies of each partition: a primary and ``replication - 1`` hot replicas.
    replication: int = 2
    slots: int = DEFAULT_SLOTS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: After start, only claims of shards that already serve a partition are
    #: granted for this long (None: two liveness timeouts), so a restarted
    #: broker rebuilds its map from the shards before it assigns anything new.
    startup_grace: float | None = None
    #: Flow control: bytes the broker holds for one client that reads slower than it is
    #: answered (beyond zmq's own queue); past it, replies to that client are dropped.
    client_queue_bytes: int = 8 << 20
    #: Bytes held for one shard; past it, requests for that shard are refused OVERLOADED.
    shard_queue_bytes: int = 64 << 20
    #: Bytes held for all peers together.
    queue_bytes: int = 512 << 20
    #: A peer that takes none of what is held for it for this many seconds loses it.
    stall_timeout: float = 10.0
    #: Where the broker keeps what it must not forget (partitions, epochs, the LSN
    #: each primary confirmed, training jobs); None: nothing survives a restart.
    data_dir: str | None = None
    #: A primary/backup pair (Binary Star): this broker's role, "primary" or "backup"
    #: (None: no pair) ...
    pair_role: str | None = None
    #: ... where it listens for its peer broker ...
    peer_bind: str | None = None
    #: ... and the peer broker's peer endpoint.
    peer: str | None = None
    #: Seconds without a heartbeat from the peer before it counts as lost (the peers
    #: beat five times as often).
    peer_timeout: float = 0.5
    #: A routing broker (zps/broker/router.py): the broker, or the pair, whose map it
    #: follows ("tcp://a:5555" or "tcp://a:5555,tcp://b:5555"); None: a full broker.
    follow: str | None = None
    #: A routing broker's endpoint as clients and shards reach it (default: ``bind``
    #: with the local address on the route to the followed broker) ...
    advertise: str | None = None
    #: ... and the host it runs on, as shards name theirs (``shard.host``; default:
    #: the host name): a partition's requests go to the router on its primary's host.
    host: str | None = None
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    security: Security = field(default_factory=Security)
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        _endpoint("broker", "bind", self.bind)
        _integer(
            "broker",
            1,
            partitions=self.partitions,
            replication=self.replication,
            slots=self.slots,
            max_message_bytes=self.max_message_bytes,
        )
        _integer(
            "broker",
            0,
            client_queue_bytes=self.client_queue_bytes,
            shard_queue_bytes=self.shard_queue_bytes,
            queue_bytes=self.queue_bytes,
        )
        _positive("broker", stall_timeout=self.stall_timeout, peer_timeout=self.peer_timeout)
        if self.data_dir is not None and (not isinstance(self.data_dir, str) or not self.data_dir):
            raise ConfigError(f"broker.data_dir must be a directory path, got {self.data_dir!r}")
        pair = (self.pair_role, self.peer_bind, self.peer)
        if any(v is not None for v in pair):
            if self.pair_role not in ("primary", "backup"):
                raise ConfigError(
                    f'broker.pair_role must be "primary" or "backup", got {self.pair_role!r}'
                )
            if self.peer_bind is None or self.peer is None:
                raise ConfigError(
                    "a broker pair needs broker.pair_role, broker.peer_bind and broker.peer"
                )
            _endpoint("broker", "peer_bind", self.peer_bind)
            _endpoint("broker", "peer", self.peer)
        if self.follow is not None:
            broker_endpoints(self.follow, "broker.follow")
            if self.pair_role is not None:
                raise ConfigError("a routing broker (broker.follow) cannot be one of a pair")
        if self.advertise is not None:
            _endpoint("broker", "advertise", self.advertise)
        if self.startup_grace is not None and (
            isinstance(self.startup_grace, bool)
            or not isinstance(self.startup_grace, int | float)
            or not 0 <= self.startup_grace < 3600
        ):
            raise ConfigError(
                f"broker.startup_grace must be seconds in [0, 3600), got {self.startup_grace!r}"
            )
        if self.slots < self.partitions:
            raise ConfigError(
                f"broker.slots ({self.slots}) must be >= broker.partitions ({self.partitions})"
            )

    @property
    def grace(self) -> float:
        if self.startup_grace is not None:
            return float(self.startup_grace)
        return 2 * self.heartbeat.interval * self.heartbeat.liveness

    @property
    def followed(self) -> tuple[str, ...]:
        """A routing broker's followed broker (or pair); () for a full broker."""
        return () if self.follow is None else broker_endpoints(self.follow, "broker.follow")


@dataclass(frozen=True)
class ShardConfig:
    #: The broker, or a comma-separated primary/backup pair of them.
    broker: str = DEFAULT_BROKER
    #: The broker pair as a list (overrides ``broker`` when given).
    brokers: tuple[str, ...] = ()
    #: Checkpoints go here (None: no checkpoints, nothing restored).
    data_dir: str | None = None
    #: Where replicas of this shard's partition connect (port 0: any free port).
    replication_bind: str = "tcp://*:0"
    #: The host replicas use to reach this shard (None: the local address on
    #: the route to the broker).
    advertise_host: str | None = None
    #: The host this shard reports for placement: the broker keeps copies of a
    #: partition on distinct hosts where it can (None: the hostname).
    host: str | None = None
    #: An optional zone or rack label; copies are kept in distinct zones too.
    zone: str = ""
    #: The shard's name in status, logs and metrics (its node id is ``s-NAME``); None:
    #: the host name and the data dir's name (or the pid, without a data dir).
    name: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Flow control: bytes of replies held for the broker while its queue is full.  A
    #: request is refused OVERLOADED while more than this minus ``max_message_bytes``
    #: is held, so the reply to every request taken fits (at least twice
    #: ``max_message_bytes``).
    reply_queue_bytes: int = 256 << 20
    #: What an acknowledged write survives (with a ``data_dir``; each partition keeps
    #: a write-ahead log there): "fsync" (a write is on disk before it is
    #: acknowledged: the loss of every machine at once), "interval" (on disk at most
    #: ``durability_interval`` seconds after it: the loss of every process at once,
    #: and of the machines but for that last interval), "none" (memory and
    #: checkpoints only: up to a checkpoint interval is lost with every copy).
    durability: str = "interval"
    durability_interval: float = 0.1
    #: The write-ahead log begins a new file past this size (and at each checkpoint).
    wal_segment_bytes: int = 64 << 20
    #: Shared memory for reply frames of 192 KiB and more to clients on this host, at
    #: most this many bytes (:mod:`zps.shm`); 0 turns the path off both ways.  Dense
    #: chunks of 1 MiB and more live there, up to a quarter of it (pulls then lend them).
    shm_bytes: int = 128 << 20
    #: Seconds the answer to a client's background pushes may be held, once the
    #: replicas (or the log) have them, for the reply to its next request to carry
    #: (a pipelined step then costs one reply, not two); 0 sends each at once.  A
    #: client's ``flush()`` and ``clock()`` ask for what is held.
    ack_hold_s: float = 0.01
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    security: Security = field(default_factory=Security)
    metrics: Metrics = field(default_factory=Metrics)
    limits: Limits = field(default_factory=Limits)
    replication: Replication = field(default_factory=Replication)

    def __post_init__(self) -> None:
        broker_endpoints(*given_brokers("shard", self.brokers, self.broker))
        _endpoint("shard", "replication_bind", self.replication_bind)
        _integer("shard", 1, max_message_bytes=self.max_message_bytes)
        _integer("shard", 1, reply_queue_bytes=self.reply_queue_bytes)
        if self.reply_queue_bytes < 2 * self.max_message_bytes:
            raise ConfigError(
                f"shard.reply_queue_bytes ({self.reply_queue_bytes}) must be at least twice "
                f"shard.max_message_bytes ({self.max_message_bytes})"
            )
        if self.data_dir is not None and (not isinstance(self.data_dir, str) or not self.data_dir):
            raise ConfigError(f"shard.data_dir must be a directory path, got {self.data_dir!r}")
        if self.host is not None and (not isinstance(self.host, str) or not self.host):
            raise ConfigError(f"shard.host must be a non-empty name, got {self.host!r}")
        if self.name is not None and (
            not isinstance(self.name, str) or not SHARD_NAME.fullmatch(self.name)
        ):
            raise ConfigError(
                f"shard.name must be 1-60 letters, digits, '.', '_' or '-', starting with a "
                f"letter or digit, got {self.name!r}"
            )
        if not isinstance(self.zone, str) or len(self.zone) > 100:
            raise ConfigError(
                f"shard.zone must be a label of at most 100 characters, got {self.zone!r}"
            )
        if self.durability not in ("fsync", "interval", "none"):
            raise ConfigError(
                f'shard.durability must be "fsync", "interval" or "none", got {self.durability!r}'
            )
        _positive("shard", durability_interval=self.durability_interval)
        _integer("shard", 1 << 16, wal_segment_bytes=self.wal_segment_bytes)
        _integer("shard", 0, shm_bytes=self.shm_bytes)
        hold = self.ack_hold_s
        if isinstance(hold, bool) or not isinstance(hold, int | float) or not 0 <= hold <= 1:
            raise ConfigError(f"shard.ack_hold_s must be seconds from 0 to 1, got {hold!r}")

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every broker endpoint (two for a broker pair)."""
        return broker_endpoints(*given_brokers("shard", self.brokers, self.broker))


@dataclass(frozen=True)
class ClientConfig:
    timeout: float = 30.0
    connect_timeout: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Small operations to one partition issued together travel in one message,
    #: up to this many operations ...
    batch_max_ops: int = 512
    #: ... and this many payload bytes.
    batch_max_bytes: int = 4 << 20
    #: A call is cut into messages whose request and reply payloads are at most
    #: this many bytes each (at most half of ``max_message_bytes``).
    message_budget: int = MESSAGE_BUDGET
    compress: bool = True
    name: str = ""
    #: "all": a write returns once every in-sync replica applied it; 1: once the
    #: primary did (faster; a write acknowledged just before the primary dies
    #: can be lost).
    acks: str | int = "all"
    #: Training mode of the job: "async" (apply each push on arrival), "sync"
    #: (average all workers' gradients per step, apply once), or "ssp" (a
    #: worker may be at most ``staleness`` steps ahead of the slowest).
    mode: str = "async"
    staleness: int = 0
    #: Pushes sent with ``wait=False`` that may be unacknowledged at once.
    max_background: int = 8
    #: With a broker pair: seconds without a word from the current broker before the
    #: client turns to the other one.
    failover_timeout: float = 0.5
    #: Shared memory for payload frames of 192 KiB and more to and from shards on this
    #: host, at most this many bytes (:mod:`zps.shm`); 0 turns the path off.
    shm_bytes: int = 128 << 20
    #: At its start, the client keeps this process's freed buffers below 4 MiB in the
    #: heap (:func:`zps.ops.malloc.tune`, as ``zps-server`` and ``zps-worker`` do):
    #: each large message otherwise costs a page fault per 4 KiB.  Process-wide; false
    #: leaves the allocator alone (so do ``MALLOC_MMAP_THRESHOLD_`` and
    #: ``MALLOC_TRIM_THRESHOLD_`` in the environment).
    tune_malloc: bool = True
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    security: Security = field(default_factory=Security)

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync", "ssp"):
            raise ConfigError(f'client.mode must be "async", "sync" or "ssp", got {self.mode!r}')
        _integer("client", 0, staleness=self.staleness)
        _integer("client", 1, max_background=self.max_background)
        if self.acks not in ("all", 1) or isinstance(self.acks, bool):
            raise ConfigError(f'client.acks must be "all" or 1, got {self.acks!r}')
        _positive(
            "client",
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            failover_timeout=self.failover_timeout,
        )
        _integer(
            "client",
            1,
            max_message_bytes=self.max_message_bytes,
            batch_max_ops=self.batch_max_ops,
            batch_max_bytes=self.batch_max_bytes,
            message_budget=self.message_budget,
        )
        _integer("client", 0, shm_bytes=self.shm_bytes)
        if self.message_budget > self.max_message_bytes // 2:
            raise ConfigError(
                f"client.message_budget ({self.message_budget}) must be at most half of "
                f"client.max_message_bytes ({self.max_message_bytes})"
            )
        if not isinstance(self.compress, bool):
            raise ConfigError(f"client.compress must be true or false, got {self.compress!r}")
        if not isinstance(self.tune_malloc, bool):
            raise ConfigError(f"client.tune_malloc must be true or false, got {self.tune_malloc!r}")


@dataclass(frozen=True)
class WorkerConfig:
    #: The broker, or a comma-separated primary/backup pair of them.
    broker: str = DEFAULT_BROKER
    #: The broker pair as a list (overrides ``broker`` when given).
    brokers: tuple[str, ...] = ()
    #: MODULE:FUNCTION that zps-worker runs (a flag overrides it).
    function: str | None = None
    args: tuple[str, ...] = ()
    #: Seconds the training function has, after the first SIGTERM/SIGINT, to see
    #: ``ps.stop_requested`` and return; then zps-worker exits with code 124.
    stop_grace: float = 10.0
    #: Under systemd's watchdog: a client call still in flight this many seconds after
    #: its deadline (or the blocking client's event loop held this long) stops the pings.
    stall_margin: float = 60.0
    #: The worker's Prometheus endpoint (0: none).  Its own key, not ``[metrics] port``,
    #: which the broker and shards share; the address is ``[metrics] host``.
    metrics_port: int = 0
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        broker_endpoints(*given_brokers("worker", self.brokers, self.broker))
        _positive("worker", stop_grace=self.stop_grace, stall_margin=self.stall_margin)
        _integer("worker", 0, metrics_port=self.metrics_port)
        if self.metrics_port > 65535:
            raise ConfigError(f"worker.metrics_port must be <= 65535, got {self.metrics_port}")
        if not all(isinstance(a, str) for a in self.args):
            raise ConfigError("worker.args must be a list of strings")

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every broker endpoint (two for a broker pair)."""
        return broker_endpoints(*given_brokers("worker", self.brokers, self.broker))


@dataclass(frozen=True)
class Settings:
    """Everything one TOML file can say."""

    broker: BrokerConfig = field(default_factory=BrokerConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    source: str | None = None  # the file they came from, if any


# Sections shared by several processes, and which configs they feed.
_SHARED = {
    "heartbeat": (Heartbeat, ("broker", "shard", "client")),
    "security": (Security, ("broker", "shard", "client")),
    "metrics": (Metrics, ("broker", "shard", "worker")),
    "checkpoint": (Checkpoint, ("shard",)),
    "limits": (Limits, ("shard",)),
    "replication": (Replication, ("shard",)),
}
_OWN = {
    "broker": BrokerConfig,
    "shard": ShardConfig,
    "client": ClientConfig,
    "worker": WorkerConfig,
}
_NESTED = set(_SHARED)

_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "str | None": (str,),
    "float | None": (int, float),
    "str | int": (str, int),
    "tuple[str, ...]": (list,),
}


def _fields_of(cls: type, table: Mapping[str, Any], section: str, path: str) -> dict[str, Any]:
    # A shared section is not a key of its users ([broker] replication is the broker's own).
    known = {
        f.name: f
        for f in fields(cls)
        if f.name not in _NESTED or str(f.type) != _SHARED[f.name][0].__name__
    }
    out: dict[str, Any] = {}
    for key, value in table.items():
        f = known.get(key)
        if f is None:
            hint = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(
                f"{path}: unknown key '{section}.{key}'"
                + (f" (did you mean '{section}.{hint[0]}'?)" if hint else "")
            )
        allowed = _TYPES.get(str(f.type))
        if allowed is not None and (
            not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
        ):
            raise ConfigError(f"{path}: '{section}.{key}' must be {f.type}, got {value!r}")
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def load_settings(path: str | None, *, required: bool = True) -> Settings:
    """Parse a TOML file into :class:`Settings` (defaults if ``path`` is None)."""
    if path is None:
        return Settings()
    p = Path(path)
    if not p.exists():
        if required:
            raise ConfigError(f"config file {path} does not exist")
        return Settings()
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return settings_from_mapping(data, str(p))


def settings_from_mapping(data: Mapping[str, Any], path: str = "config") -> Settings:
    for section, table in data.items():
        if section not in _OWN and section not in _SHARED:
            hint = difflib.get_close_matches(section, [*_OWN, *_SHARED], n=1)
            raise ConfigError(
                f"{path}: unknown section [{section}]"
                + (f" (did you mean [{hint[0]}]?)" if hint else "")
            )
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path}: '{section}' must be a table ([{section}])")
    try:
        shared = {
            name: cls(**_fields_of(cls, data.get(name, {}), name, path))
            for name, (cls, _) in _SHARED.items()
        }
        built: dict[str, Any] = {}
        for name, cls in _OWN.items():
            kwargs = _fields_of(cls, data.get(name, {}), name, path)
            for shared_name, (_, users) in _SHARED.items():
                if name in users:
                    kwargs[shared_name] = shared[shared_name]
            built[name] = cls(**kwargs)
    except ConfigError as e:
        if str(e).startswith(path):
            raise
        raise ConfigError(f"{path}: {e}") from None
    return Settings(**built, source=path)


def override(config: T, **flags: Any) -> T:
    """``config`` with the flags that were given (not None) replacing its values."""
    given = {k: v for k, v in flags.items() if v is not None}
    return replace(config, **given) if given else config  # type: ignore[type-var]
