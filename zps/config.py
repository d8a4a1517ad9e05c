"""Settings of each process, as frozen dataclasses parsed once and passed down.

Nothing else in zps reads the environment or files for settings; the CLI
builds these from flags and hands them to the drivers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from zps.codec import DEFAULT_MAX_MESSAGE_BYTES
from zps.errors import ConfigError
from zps.routing import DEFAULT_SLOTS

DEFAULT_BROKER = "tcp://127.0.0.1:5555"
DEFAULT_BIND = "tcp://*:5555"


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(
                f"{type(obj).__name__}.{name} must be a positive number, got {value!r}"
            )


def _check_endpoint(owner: str, key: str, value: str) -> None:
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(
            f"{owner}.{key} must be a ZeroMQ endpoint like tcp://HOST:PORT, got {value!r}"
        )


@dataclass(frozen=True)
class Heartbeat:
    """A peer silent for ``interval * liveness`` seconds is declared dead."""

    interval: float = 0.2
    liveness: int = 5

    def __post_init__(self) -> None:
        _check_positive(self, "interval", "liveness")
        if not isinstance(self.liveness, int):
            raise ConfigError(f"Heartbeat.liveness must be an integer, got {self.liveness!r}")


@dataclass(frozen=True)
class BrokerConfig:
    bind: str = DEFAULT_BIND
    partitions: int = 2
    #: Copies of each partition: a primary and ``replication - 1`` hot replicas.
    replication: int = 2
    slots: int = DEFAULT_SLOTS
    heartbeat: Heartbeat = Heartbeat()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: After start, only claims of shards that already serve a partition are
    #: granted for this long (None: two liveness timeouts), so a restarted
    #: broker rebuilds its map from the shards before it assigns anything new.
    startup_grace: float | None = None

    @property
    def grace(self) -> float:
        if self.startup_grace is not None:
            return self.startup_grace
        return 2 * self.heartbeat.interval * self.heartbeat.liveness

    def __post_init__(self) -> None:
        _check_endpoint("broker", "bind", self.bind)
        _check_positive(self, "partitions", "slots", "max_message_bytes")
        for f in fields(self):
            if f.name in ("partitions", "slots", "replication") and not isinstance(
                getattr(self, f.name), int
            ):
                raise ConfigError(f"broker.{f.name} must be an integer")
        if not isinstance(self.replication, int) or self.replication < 1:
            raise ConfigError(
                f"broker.replication must be an integer >= 1 (1 = no replicas), "
                f"got {self.replication!r}"
            )
        if self.startup_grace is not None and not (
            isinstance(self.startup_grace, int | float) and 0 <= self.startup_grace < 3600
        ):
            raise ConfigError(
                f"broker.startup_grace must be seconds in [0, 3600), got {self.startup_grace!r}"
            )
        if self.slots < self.partitions:
            raise ConfigError(
                f"broker.slots ({self.slots}) must be >= broker.partitions ({self.partitions})"
            )


@dataclass(frozen=True)
class ShardConfig:
    broker: str = DEFAULT_BROKER
    heartbeat: Heartbeat = Heartbeat()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    data_dir: str | None = None
    #: Where replicas of this shard's partition connect (port 0: any free port).
    replication_bind: str = "tcp://*:0"
    #: The host replicas use to reach this shard (None: the local address on
    #: the route to the broker).
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        _check_endpoint("shard", "broker", self.broker)
        _check_endpoint("shard", "replication_bind", self.replication_bind)
        _check_positive(self, "max_message_bytes")


@dataclass(frozen=True)
class ClientConfig:
    timeout: float = 30.0
    connect_timeout: float = 10.0
    heartbeat: Heartbeat = Heartbeat()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Small operations to one partition issued together travel in one message,
    #: up to this many operations ...
    batch_max_ops: int = 512
    #: ... and this many payload bytes.
    batch_max_bytes: int = 4 << 20
    compress: bool = True
    name: str = ""
    #: "all": a write returns once every in-sync replica applied it; 1: once the
    #: primary did (faster; a write acknowledged just before the primary dies
    #: can be lost).
    acks: str | int = "all"

    def __post_init__(self) -> None:
        if self.acks not in ("all", 1):
            raise ConfigError(f'client.acks must be "all" or 1, got {self.acks!r}')
        _check_positive(
            self,
            "timeout",
            "connect_timeout",
            "max_message_bytes",
            "batch_max_ops",
            "batch_max_bytes",
        )
