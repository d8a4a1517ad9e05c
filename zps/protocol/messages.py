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

The records live in :mod:`~zps.protocol.control` (shards, clients and the broker) and
:mod:`~zps.protocol.stream` (replication), their field readers in
:mod:`~zps.protocol.fields`, the enums in :mod:`~zps.protocol.enums`; this module names
them all.  None does I/O.
"""

from __future__ import annotations

from typing import TypeAlias

from zps.protocol.control import (
    ADMIN_CLIENT_PREFIX,
    OPERATOR_TASK_OPS,
    Assign,
    Bye,
    ClientHello,
    ClockOp,
    ClockRequest,
    Heartbeat,
    HelloAgain,
    JobSettings,
    LeaseEcho,
    MapUpdate,
    RegisterAgain,
    ShardClaim,
    ShardHeartbeat,
    ShardRegister,
    StatusReply,
    StatusRequest,
    TaskOp,
    TaskRequest,
    TrainReport,
)
from zps.protocol.enums import Mode, Role, Status
from zps.protocol.fields import Header
from zps.protocol.stream import (
    Replicate,
    SnapshotAck,
    SnapshotChunk,
    StreamAck,
    Subscribe,
)

__all__ = [
    "ADMIN_CLIENT_PREFIX",
    "OPERATOR_TASK_OPS",
    "Assign",
    "BrokerToClient",
    "BrokerToShard",
    "Bye",
    "ClientControl",
    "ClientHello",
    "ClockOp",
    "ClockRequest",
    "FromReplica",
    "Header",
    "Heartbeat",
    "HelloAgain",
    "JobSettings",
    "LeaseEcho",
    "MapUpdate",
    "Mode",
    "RegisterAgain",
    "Replicate",
    "Role",
    "ShardClaim",
    "ShardControl",
    "ShardHeartbeat",
    "ShardRegister",
    "SnapshotAck",
    "SnapshotChunk",
    "Status",
    "StatusReply",
    "StatusRequest",
    "StreamAck",
    "Subscribe",
    "TaskOp",
    "TaskRequest",
    "TrainReport",
]

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
