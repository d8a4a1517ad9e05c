"""The broker's acceptance rules: what it does with a message, decided from the message
and the membership alone.

One job: :func:`accept` turns ``(sender identity, frames)`` into a :data:`Verdict`; the
broker carries the verdict out, and tests predict the broker from the same function.
No I/O, no clock, no state of its own.

Rules, in the order they apply:

1. A sender identity starting ``s-`` is a shard; one starting ``h-s-`` is that shard's
   liveness link (:mod:`zps.core.membership`), which may send only HEARTBEAT control
   messages (rule 4); any other identity is a client.
2. A client's REQUEST is routed on its route frame alone (the header is the shard's to
   read).  Any other client message must decode, be one of HELLO, HEARTBEAT, STATUS,
   CLOCK, TASK, BYE, and have a header its record accepts; a CLOCK or TASK request with
   a bad header is answered ``BAD_REQUEST`` instead of dropped (a caller waits for it).
3. A shard message starts with a target frame.  :data:`COMMIT_TARGET` marks the answer
   to a sync-mode commit: it counts only from the partition's current primary.  Any other
   non-empty target is a client to forward a reply to: never a shard identity (a
   registered peer could forge the broker's control messages), and only from a shard
   still in the membership (a shard declared dead answers too late).
4. An empty target marks a control message: REGISTER, HEARTBEAT or BYE, with a header
   its record accepts.
5. A route frame of another protocol version (rules 2 and 4) is answered
   ``VERSION_MISMATCH``, so the peer can say which versions differ.
6. Anything else is malformed: dropped and counted, never answered.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

from zps.core import membership
from zps.core.membership import is_liveness
from zps.errors import ProtocolError
from zps.protocol.codec import (
    BufferLike,
    MsgType,
    Route,
    VersionMismatchError,
    decode,
    unpack_route,
)
from zps.protocol.messages import (
    Bye,
    ClientControl,
    ClientHello,
    ClockRequest,
    Heartbeat,
    ShardControl,
    ShardHeartbeat,
    ShardRegister,
    StatusRequest,
    TaskRequest,
)

#: The pseudo client that commits sync steps; shards answer it through the broker.
COMMIT_TARGET = b"\x00commit"
#: The pseudo client that moves slots (live resharding, zps/broker/reshard.py).
MOVE_TARGET = b"\x00move"

#: Re-exported: a shard's identity starts with it.
SHARD_PREFIX = membership.SHARD_PREFIX


class Membership(Protocol):
    """What the rules need to know of the cluster (``ClusterState`` has it)."""

    @property
    def shards(self) -> Container[str]: ...

    def primary_of(self, partition: int) -> str | None: ...


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A client's REQUEST: route it to the partition's primary."""

    route: Route


@dataclass(frozen=True, slots=True)
class FromClient:
    """A client's control message."""

    route: Route
    message: ClientControl


@dataclass(frozen=True, slots=True)
class BadClientRequest:
    """A CLOCK or TASK request whose header is invalid: answer ``BAD_REQUEST``."""

    route: Route
    error: str


@dataclass(frozen=True, slots=True)
class FromShard:
    """A shard's control message."""

    route: Route
    message: ShardControl


@dataclass(frozen=True, slots=True)
class ForwardReply:
    """A shard's reply: forward the frames after the target to the client ``target``."""

    target: bytes


@dataclass(frozen=True, slots=True)
class CommitReply:
    """The current primary's answer to a sync-mode commit."""

    route: Route
    header: dict[str, Any]


@dataclass(frozen=True, slots=True)
class MoveReply:
    """A shard's answer to a slot move's request (payloads: the arrays it carries)."""

    route: Route
    header: dict[str, Any]
    payloads: list[BufferLike]
    node: str


@dataclass(frozen=True, slots=True)
class WrongVersion:
    """A message in another protocol version: answered VERSION_MISMATCH (in this one)."""

    error: VersionMismatchError


@dataclass(frozen=True, slots=True)
class Reject:
    """Dropped unanswered; ``counter`` names the broker statistic it counts in (``None``:
    not counted, it is harmless)."""

    reason: str
    counter: Literal["malformed", "stale_replies"] | None = "malformed"


Verdict: TypeAlias = (
    RouteRequest
    | FromClient
    | BadClientRequest
    | FromShard
    | ForwardReply
    | CommitReply
    | MoveReply
    | WrongVersion
    | Reject
)


#: What the data path decides alone: everything of a message but a control message's.
DataVerdict: TypeAlias = RouteRequest | ForwardReply | WrongVersion | Reject


def accept(ident: bytes, frames: Sequence[BufferLike], members: Membership) -> Verdict:
    """What the broker does with ``frames`` (those after the identity) from ``ident``."""
    return accept_data(ident, frames, members) or accept_control(ident, frames, members)


def accept_data(
    ident: bytes, frames: Sequence[BufferLike], members: Membership
) -> DataVerdict | None:
    """The verdict on a data message (a client's REQUEST, a shard's reply to a client,
    either malformed), from its route or target frame alone; None for a control
    message, whose verdict is :func:`accept_control`'s.  The broker's fast path asks
    this, and leaves what it returns None for to the serving task."""
    if not frames:
        return Reject("no route frame")
    if is_liveness(ident):
        return None
    try:
        if ident.startswith(SHARD_PREFIX):
            return _shard_data(ident, frames, members)
        route = unpack_route(frames[0])
    except VersionMismatchError as e:
        return WrongVersion(e)
    except ProtocolError as e:
        return Reject(str(e))
    return RouteRequest(route) if route.mtype is MsgType.REQUEST else None


def accept_control(ident: bytes, frames: Sequence[BufferLike], members: Membership) -> Verdict:
    """The verdict on a message :func:`accept_data` left to the control path (any
    message gets the verdict :func:`accept` gives it)."""
    try:
        if is_liveness(ident):
            return _from_liveness(frames)
        if ident.startswith(SHARD_PREFIX):
            return _from_shard(ident, frames, members)
        return _from_client(frames)
    except VersionMismatchError as e:
        return WrongVersion(e)
    except ProtocolError as e:
        return Reject(str(e))


def _shard_data(
    ident: bytes, frames: Sequence[BufferLike], members: Membership
) -> DataVerdict | None:
    """Rule 3 for a reply to a client; None for a control message or a pseudo client's
    answer."""
    if len(frames) < 2:
        raise ProtocolError("shard message without target and route frames")
    target = bytes(frames[0])
    if not target or target in (COMMIT_TARGET, MOVE_TARGET):
        return None
    if target.startswith(SHARD_PREFIX):
        return Reject("a reply addressed to a shard")
    if ident.decode("utf-8", "replace") not in members.shards:
        return Reject("a reply from a shard declared dead", counter="stale_replies")
    return ForwardReply(target)


def _from_client(frames: Sequence[BufferLike]) -> Verdict:
    route = unpack_route(frames[0])
    if route.mtype is MsgType.REQUEST:
        return RouteRequest(route)
    h = decode(frames).header
    message: ClientControl
    match route.mtype:
        case MsgType.HELLO:
            message = ClientHello.parse(h)
        case MsgType.HEARTBEAT:
            message = Heartbeat.parse(h)
        case MsgType.STATUS:
            try:
                message = StatusRequest.parse(h)
            except ProtocolError as e:
                return BadClientRequest(route, str(e))
        case MsgType.BYE:
            message = Bye.parse(h)
        case MsgType.CLOCK | MsgType.TASK:
            try:
                message = (ClockRequest if route.mtype is MsgType.CLOCK else TaskRequest).parse(h)
            except ProtocolError as e:
                return BadClientRequest(route, str(e))
        case _:
            raise ProtocolError(f"a client may not send {route.mtype.name}")
    return FromClient(route, message)


def _from_shard(ident: bytes, frames: Sequence[BufferLike], members: Membership) -> Verdict:
    if len(frames) < 2:
        raise ProtocolError("shard message without target and route frames")
    target = bytes(frames[0])
    if target == COMMIT_TARGET:
        reply = decode(frames[1:])
        node = ident.decode("utf-8", "replace")
        if members.primary_of(reply.route.partition) != node:
            return Reject("a commit answer from a deposed primary", counter=None)
        return CommitReply(reply.route, reply.header)
    if target == MOVE_TARGET:
        reply = decode(frames[1:])
        return MoveReply(
            reply.route, reply.header, list(reply.payloads), ident.decode("utf-8", "replace")
        )
    if target:
        verdict = _shard_data(ident, frames, members)
        assert verdict is not None
        return verdict
    route = unpack_route(frames[1])
    h = decode(frames[1:]).header
    message: ShardControl
    match route.mtype:
        case MsgType.REGISTER:
            message = ShardRegister.parse(h)
        case MsgType.HEARTBEAT:
            message = ShardHeartbeat.parse(h)
        case MsgType.BYE:
            message = Bye.parse(h)
        case _:
            raise ProtocolError(f"a shard may not send {route.mtype.name} to the broker")
    return FromShard(route, message)


def _from_liveness(frames: Sequence[BufferLike]) -> Verdict:
    """A shard's liveness link carries its heartbeats and nothing else."""
    if len(frames) < 2:
        raise ProtocolError("shard message without target and route frames")
    if bytes(frames[0]):
        return Reject("a reply on a shard's liveness link")
    route = unpack_route(frames[1])
    if route.mtype is not MsgType.HEARTBEAT:
        raise ProtocolError(f"a shard's liveness link may not send {route.mtype.name}")
    return FromShard(route, ShardHeartbeat.parse(decode(frames[1:]).header))
