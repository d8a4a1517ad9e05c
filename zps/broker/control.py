"""The broker's control plane: shards registering, heartbeating and leaving, clients
joining, operators' commands, and the assignments and maps that follow.

One job: carry out what :class:`~zps.core.cluster.ClusterState` decides for each
control message (:mod:`zps.broker.acceptance` gives the verdict): send its
assignments, publish a changed map once the record holding it is durable, echo
heartbeats (a primary's lease), answer STATUS with the report and run the operators'
drain, undrain, reset-partition and scale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, assert_never

from zps.broker.base import BrokerStats
from zps.broker.training import Training
from zps.core.cluster import Assignment, Claim, ClusterState
from zps.core.membership import FailureDetector
from zps.protocol.codec import MsgType, Route
from zps.protocol.messages import (
    ADMIN_CLIENT_PREFIX,
    Assign,
    Bye,
    ClientControl,
    ClientHello,
    ClockRequest,
    Heartbeat,
    LeaseEcho,
    MapUpdate,
    Role,
    ShardClaim,
    ShardControl,
    ShardHeartbeat,
    ShardRegister,
    StatusRequest,
    TaskRequest,
)

log = logging.getLogger("zps.broker")


class ControlSend(Protocol):
    """A broker-originated message (:meth:`zps.broker.persistence.Record.control`)."""

    def __call__(
        self,
        node: bytes,
        mtype: MsgType,
        header: dict[str, Any],
        req_id: int = 0,
        *,
        durable: bool = False,
    ) -> Awaitable[None]: ...


class ReshardCommands(Protocol):
    """What the operators' scale command needs of the resharding
    (:class:`~zps.broker.reshard.Resharder`)."""

    def request(
        self, target: int, now: float, *, max_slots: int = 0, piece_bytes: int = 0
    ) -> dict[str, Any]: ...

    def cancel(self) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any] | None: ...


class Control:
    """Registration, heartbeats, admin commands, assignments and maps (see the module
    notes).

    ``state``, ``detector`` and ``training`` are the broker's current ones (a broker of
    a pair gets new ones when it resets); ``versions`` (node -> zps release) is shared
    with the report.  The calls it makes: ``control`` (send a control message, maybe
    durably), ``forget`` (drop what is held for a peer), ``saturated`` (a client's
    allowance is spent), ``status`` (the report), ``state_changed``,
    ``epoch_unrecorded``, ``map_changed`` (the partition count and the route table
    follow the map) and ``log_states`` (log each partition's change of state)."""

    def __init__(
        self,
        state: ClusterState,
        detector: FailureDetector,
        training: Training,
        reshard: ReshardCommands,
        stats: BrokerStats,
        versions: dict[str, str],
        *,
        control: ControlSend,
        forget: Callable[[bytes], None],
        saturated: Callable[[bytes], bool],
        status: Callable[[float], dict[str, Any]],
        state_changed: Callable[[], None],
        epoch_unrecorded: Callable[[int], bool],
        map_changed: Callable[[float], None],
        log_states: Callable[[float], None],
    ) -> None:
        self.state = state
        self.detector = detector
        self.training = training
        self.reshard = reshard
        self.stats = stats
        self.versions = versions
        self.control = control
        self._forget = forget
        self._saturated = saturated
        self._status = status
        self.state_changed = state_changed
        self._epoch_unrecorded = epoch_unrecorded
        self._map_changed = map_changed
        self._log_states = log_states
        self.keys: dict[str, str] = {}  # shard -> CURVE public key (for its replicas)
        self.incarnations: dict[str, str] = {}  # shard -> its process (from REGISTER)

    def forget(self, ident: bytes) -> None:
        """A peer left: drop what is held for it (and its recorded release)."""
        node = ident.decode("utf-8", "replace")
        self.versions.pop(node, None)
        self.incarnations.pop(node, None)
        self._forget(ident)

    async def apply(self, assignments: list[Assignment]) -> None:
        for a in assignments:
            log.info(
                "assign %s: %s at epoch %d%s",
                a.node_id,
                a.role.value
                if a.partition is None
                else f"{a.role.value} of partition {a.partition}",
                a.epoch,
                f", following {a.primary}" if a.primary else "",
            )
            await self.control(
                a.node_id.encode(),
                MsgType.ASSIGN,
                Assign(
                    role=a.role,
                    partition=a.partition,
                    epoch=a.epoch,
                    primary=a.primary,
                    primary_address=a.primary_address,
                    primary_key=self.keys.get(a.primary or "", ""),
                    n_partitions=self.state.n_partitions,
                ).to_wire(),
            )

    async def publish_if_changed(self, before: int) -> None:
        self.log_notices()
        if self.state.map_version == before:
            return
        self.state_changed()
        self._map_changed(time.monotonic())
        # A map goes out once the record holding it is durable: a primary releases the
        # writes that waited for a replica only when a map drops that replica from the
        # in-sync set, and a restart must not elect the dropped copy.
        wire = MapUpdate(self.state.map.to_wire()).to_wire()
        # Shards also get the shards' keys: a primary takes a replica's subscription
        # only from the key that registered the replica's name.
        keys = {n: k for n, k in self.keys.items() if n in self.state.shards}
        shard_wire = MapUpdate(self.state.map.to_wire(), keys).to_wire()
        for node in self.state.clients:
            await self.control(node.encode(), MsgType.MAP, wire, durable=True)
        for node in self.state.shards:
            await self.control(node.encode(), MsgType.MAP, shard_wire, durable=True)
        self._log_states(time.monotonic())
        await self.training.on_map_change()

    def log_notices(self) -> None:
        levels = {"error": logging.ERROR, "warning": logging.WARNING}
        for level, message in self.state.notices:
            log.log(levels.get(level, logging.INFO), "%s", message)
        self.state.notices.clear()

    async def from_client(
        self, ident: bytes, node: str, route: Route, message: ClientControl, now: float
    ) -> None:
        match message:
            case ClientHello(host, pid, name, version, router) if router:
                # A routing broker (zps/broker/router.py): listed in the map, which it
                # follows like a client.
                if node not in self.state.routers:
                    log.info("router %s joined at %s (%s pid %s)", node, router, host, pid)
                self.state.register_router(node, endpoint=router, host=host, now=now, pid=pid)
                self.versions[node] = version
                await self.control(
                    ident, MsgType.MAP, MapUpdate(self.state.map.to_wire()).to_wire()
                )
            case ClientHello(host, pid, name, version):
                self.state.register_client(node, host=host, pid=pid, name=name, now=now)
                self.versions[node] = version
                # An admin command (status, drain, ...) connects for one query: debug only.
                log.log(
                    logging.DEBUG if (name or "").startswith(ADMIN_CLIENT_PREFIX) else logging.INFO,
                    "client %s joined (%s pid %s)",
                    node,
                    host,
                    pid,
                )
                await self.control(
                    ident, MsgType.MAP, MapUpdate(self.state.map.to_wire()).to_wire()
                )
            case Heartbeat(train):
                if node not in self.state.clients:  # the broker restarted: re-introduce
                    await self.control(ident, MsgType.HELLO, {})
                if train is not None:  # what ps.report recorded: the status page plots it
                    self.training.on_report(node, train, time.time())
            case StatusRequest(reset, accept_loss, drain, undrain):
                result = None if reset is None else await self._reset(reset, accept_loss, now)
                drained = (
                    None
                    if drain is None and undrain is None
                    else await self._drain(drain or undrain or "", now, undo=drain is None)
                )
                if self._saturated(ident):
                    self.stats.dropped += 1  # it reads nothing: spare the work
                    return
                report = self._status(now)
                if result is not None:
                    report["reset"] = result
                if drained is not None:
                    report["drain"] = drained
                if message.scale is not None or message.scale_cancel:
                    report["scale"] = (
                        self.reshard.cancel()
                        if message.scale_cancel
                        else self.reshard.request(
                            message.scale or 0,
                            now,
                            max_slots=message.scale_max_slots,
                            piece_bytes=message.scale_piece_bytes,
                        )
                    )
                    report["reshard"] = self.reshard.status()
                await self.control(ident, MsgType.STATUS, report, route.req_id)
            case ClockRequest():
                await self.training.on_clock(ident, node, route, message)
                self.state_changed()
            case TaskRequest():
                await self.training.on_task(ident, node, route, message)
                self.state_changed()
            case Bye():
                self.detector.forget(node)
                self.forget(ident)
                self.state.node_gone(node, now)
                await self.training.worker_gone(node)
                self.state_changed()
            case _:
                assert_never(message)

    async def from_shard(self, ident: bytes, node: str, message: ShardControl, now: float) -> None:
        match message:
            case ShardRegister():
                claim = _claim(message.claim)
                earlier = self.incarnations.get(node)
                if (
                    earlier
                    and message.incarnation
                    and earlier != message.incarnation
                    and node in self.state.shards
                ):
                    # A restarted shard (names are stable): its earlier process is gone,
                    # with whatever it held; the new one is admitted afresh.
                    log.warning(
                        "shard %s registered again as a new process (%s pid %s): the "
                        "earlier one is gone (two live shards must not share a name)",
                        node,
                        message.host,
                        message.pid,
                    )
                    self.forget(ident)
                    self.keys.pop(node, None)
                    await self.apply(self.state.node_gone(node, now))
                self.incarnations[node] = message.incarnation
                if message.public_key is not None:  # a Z85 CURVE public key
                    self.keys[node] = message.public_key
                self.versions[node] = message.version
                log.info(
                    "shard %s registered (%s pid %s, replication at %s)%s",
                    node,
                    message.host,
                    message.pid,
                    message.address,
                    f", claiming {claim.role.value} of partition {claim.partition} at "
                    f"epoch {claim.epoch}, LSN {claim.lsn}"
                    if claim
                    else "",
                )
                await self.apply(
                    self.state.register_shard(
                        node,
                        host=message.host,
                        pid=message.pid,
                        address=message.address,
                        now=now,
                        claim=claim,
                        zone=message.zone,
                        refused=message.refused,
                    )
                )
            case ShardHeartbeat():
                shard = self.state.shards.get(node)
                if shard is None:
                    await self.control(ident, MsgType.REGISTER, {})
                    return
                p = shard.partition
                self.state.report(
                    node,
                    lsn=message.lsn,
                    stats=message.stats,
                    epoch=message.epoch,
                    in_sync=None if message.in_sync is None else list(message.in_sync),
                    durable=message.durable,
                    t=message.t,
                )
                if shard.role is Role.PRIMARY:
                    self.state_changed()  # its LSN raises its partition's floor
                # The echo renews the shard's lease, for exactly this role (nothing while
                # it is fenced); it goes back on the connection the heartbeat came by (the
                # shard's liveness link, so it never waits behind data queued for the
                # shard).  Until the record names a promoted primary's epoch (and so it as
                # the partition's in-sync set), its echoes wait for the record: it takes
                # no write before that is durable.
                role, partition, epoch = self.state.lease_echo(node)
                echo = LeaseEcho(message.t, role, partition, epoch)
                unrecorded = p is not None and role is Role.PRIMARY and self._epoch_unrecorded(p)
                await self.control(ident, MsgType.HEARTBEAT, echo.to_wire(), durable=unrecorded)
                if message.new_link and p is not None and shard.role is Role.PRIMARY:
                    # Its data link's connection was made again: what was forwarded by the
                    # one before may be lost with it, so the clients send again what they
                    # have in flight to its partition (the dedup record keeps each once).
                    relinked = Heartbeat(relinked=(p,)).to_wire()
                    for client in self.state.clients:
                        await self.control(client.encode(), MsgType.HEARTBEAT, relinked)
            case Bye():
                log.info("shard %s left", node)
                self.detector.forget(node)
                self.forget(ident)
                self.keys.pop(node, None)
                await self.apply(self.state.node_gone(node, now, planned=True))
            case _:
                assert_never(message)

    async def _drain(self, node: str, now: float, *, undo: bool) -> dict[str, Any]:
        """An operator's drain / undrain: answered in the status report."""
        try:
            out = self.state.undrain(node, now) if undo else self.state.drain(node, now)
        except ValueError as e:
            return {"ok": False, "msg": str(e)}
        log.warning("shard %s %s by an operator", node, "undrained" if undo else "drained")
        await self.apply(out)
        self.state_changed()
        return {
            "ok": True,
            "msg": f"{node} undrained: it may take roles again"
            if undo
            else f"{node} drained: it holds no role until `zps-server undrain {node}`",
        }

    async def _reset(self, p: int, accept_loss: bool, now: float) -> dict[str, Any]:
        """An operator's reset-partition: answered in the status report."""
        if not accept_loss:
            return {"ok": False, "msg": "reset-partition needs accept_data_loss"}
        try:
            out = self.state.reset_partition(p, now)
        except ValueError as e:
            return {"ok": False, "msg": str(e)}
        await self.apply(out)
        self.state_changed()
        primary = self.state.primary_of(p)
        return {
            "ok": True,
            "msg": f"partition {p} reset: "
            + (
                f"served by {primary} at epoch {self.state.map.partitions[p].epoch}"
                if primary
                else "the next shard to register takes it"
            ),
        }


def _claim(claim: ShardClaim | None) -> Claim | None:
    if claim is None:
        return None
    return Claim(
        claim.partition,
        claim.epoch,
        claim.role,
        claim.lsn,
        claim.in_sync,
        claim.complete,
        claim.slots,
        claim.slot_version,
        claim.fenced,
        claim.importing,
    )
