"""``zps-server broker`` and ``zps-server shard``: the serving processes (a full broker,
a routing broker with ``--follow``, a shard), their flags and their settings."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

from zps.cli.common import (
    add_common,
    heartbeat_of,
    on_signals,
    run_async,
    settings_of,
    setup_logging,
)
from zps.ops.config import BrokerConfig, Checkpoint, Metrics, Settings, ShardConfig, override
from zps.ops.systemd import Notifier


def add_parsers(sub: Any) -> None:
    """Register ``broker`` and ``shard`` on the subcommands ``sub`` of zps-server."""
    b = sub.add_parser("broker", help="run the broker (routing, cluster map, heartbeats)")
    b.add_argument("--bind", help=f"endpoint to bind (default {BrokerConfig.bind})")
    b.add_argument(
        "--partitions", type=int, help=f"number of partitions (default {BrokerConfig.partitions})"
    )
    b.add_argument(
        "--replication",
        type=int,
        help="copies of each partition: a primary and N-1 hot replicas "
        f"(default {BrokerConfig.replication})",
    )
    b.add_argument(
        "--slots",
        type=int,
        help=f"hash slots, fixed for the cluster's life (default {BrokerConfig.slots})",
    )
    b.add_argument(
        "--startup-grace",
        type=float,
        metavar="SECONDS",
        help="after start, grant only claims of shards that already serve a "
        "partition for this long (default: two liveness timeouts)",
    )
    b.add_argument(
        "--data-dir",
        help="directory for the broker's state (partitions, epochs, training jobs), "
        "so a restart forgets nothing (default: none)",
    )
    b.add_argument(
        "--pair-role",
        choices=("primary", "backup"),
        help="run as one of a primary/backup broker pair (hot standby); needs --peer "
        "and --peer-bind",
    )
    b.add_argument("--peer-bind", help="pair: endpoint this broker's peer link binds")
    b.add_argument("--peer", help="pair: the other broker's peer link endpoint")
    b.add_argument(
        "--peer-timeout",
        type=float,
        metavar="SECONDS",
        help=f"pair: the peer counts as lost after this silence (default "
        f"{BrokerConfig.peer_timeout})",
    )
    b.add_argument(
        "--follow",
        metavar="PRIMARY[,BACKUP]",
        help="run a routing broker: follow the map of this broker (or pair), route "
        "pushes and pulls between clients and shards, own nothing (default: a full broker)",
    )
    b.add_argument(
        "--advertise",
        help="routing broker: its endpoint as clients and shards reach it (default: the "
        "bound port at the local address on the route to the followed broker)",
    )
    b.add_argument(
        "--host",
        help="routing broker: the host it runs on, as shards name theirs (default: the "
        "host name); partitions whose primary is on that host are routed by it",
    )
    b.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (default: none)")
    b.add_argument(
        "--metrics-host",
        help=f"address the metrics endpoint binds (default {Metrics.host}: this host only)",
    )
    add_common(b)

    s = sub.add_parser("shard", help="run a shard (serves one partition)")
    s.add_argument(
        "--broker",
        help=f"broker endpoint, or a broker pair as PRIMARY,BACKUP (default {ShardConfig.broker})",
    )
    s.add_argument("--data-dir", help="directory for checkpoints (default: none)")
    s.add_argument(
        "--name",
        help="this shard's name in status, logs and metrics (node id s-NAME; default: "
        "the host name and the data dir's name, or the pid without a data dir)",
    )
    s.add_argument(
        "--replication-bind",
        help=f"endpoint replicas connect to (default {ShardConfig.replication_bind}: "
        "any free port)",
    )
    s.add_argument(
        "--advertise-host",
        help="host replicas use to reach this shard (default: the local address "
        "on the route to the broker)",
    )
    s.add_argument(
        "--host",
        help="host name reported for placement: copies of a partition go to distinct "
        "hosts where possible (default: the hostname)",
    )
    s.add_argument("--zone", help="zone or rack label; copies go to distinct zones too")
    s.add_argument(
        "--checkpoint-interval",
        type=float,
        metavar="SECONDS",
        help=f"seconds between checkpoints, 0 = only on shutdown "
        f"(default {Checkpoint.interval_s:g})",
    )
    s.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="UPDATES",
        help="also checkpoint after this many updates (default 0: off)",
    )
    s.add_argument(
        "--checkpoint-keep",
        type=int,
        metavar="N",
        help=f"checkpoints kept per partition (default {Checkpoint.keep})",
    )
    s.add_argument(
        "--durability",
        choices=["fsync", "interval", "none"],
        help="what an acknowledged write survives, with --data-dir: fsync = on disk "
        "before the ack, interval = on disk within --durability-interval, none = "
        f"checkpoints only (default {ShardConfig.durability})",
    )
    s.add_argument(
        "--durability-interval",
        type=float,
        metavar="SECONDS",
        help="interval mode: the longest an acknowledged write waits for fsync "
        f"(default {ShardConfig.durability_interval:g})",
    )
    s.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (default: none)")
    s.add_argument(
        "--metrics-host",
        help=f"address the metrics endpoint binds (default {Metrics.host}: this host only)",
    )
    add_common(s)


def run(args: argparse.Namespace) -> int:
    """Serve as ``args.command`` (broker or shard) until SIGTERM or SIGINT."""
    settings = settings_of(args)
    setup_logging(args.log_level or "info")
    if args.command == "broker":
        return run_async(_serve_broker(broker_config(args, settings)))
    return run_async(_serve_shard(shard_config(args, settings)))


def broker_config(args: argparse.Namespace, settings: Settings) -> BrokerConfig:
    base = settings.broker
    return override(
        base,
        bind=args.bind,
        partitions=args.partitions,
        replication=args.replication,
        slots=args.slots,
        startup_grace=args.startup_grace,
        data_dir=args.data_dir,
        pair_role=args.pair_role,
        peer=args.peer,
        peer_bind=args.peer_bind,
        peer_timeout=args.peer_timeout,
        follow=args.follow,
        advertise=args.advertise,
        host=args.host,
        heartbeat=heartbeat_of(args, base.heartbeat),
        metrics=override(base.metrics, port=args.metrics_port, host=args.metrics_host),
    )


def shard_config(args: argparse.Namespace, settings: Settings) -> ShardConfig:
    base = settings.shard
    if args.broker is not None:  # the flag overrides the file's broker or brokers
        base = replace(base, brokers=())
    return override(
        base,
        broker=args.broker,
        data_dir=args.data_dir,
        name=args.name,
        replication_bind=args.replication_bind,
        advertise_host=args.advertise_host,
        host=args.host,
        zone=args.zone,
        durability=args.durability,
        durability_interval=args.durability_interval,
        heartbeat=heartbeat_of(args, base.heartbeat),
        metrics=override(base.metrics, port=args.metrics_port, host=args.metrics_host),
        checkpoint=override(
            base.checkpoint,
            interval_s=args.checkpoint_interval,
            every_updates=args.checkpoint_every,
            keep=args.checkpoint_keep,
        ),
    )


async def _serve_broker(config: BrokerConfig) -> int:
    from zps.broker.broker import Broker
    from zps.broker.router import Router

    broker: Broker | Router
    if config.follow is not None:
        broker = Router(config, notifier=Notifier.from_env(os.environ))
    else:
        broker = Broker(config, notifier=Notifier.from_env(os.environ))
    on_signals(broker.stop)
    await broker.run()
    return 0


async def _serve_shard(config: ShardConfig) -> int:
    from zps.shard.server import ShardServer
    from zps.store import lowfds

    # Before any socket: the memory files of its tables go below them (see zps.store.lowfds).
    lowfds.reserve()

    server = ShardServer(config, notifier=Notifier.from_env(os.environ))
    on_signals(server.stop)
    await server.run()
    return 0
