"""What the shard and client drivers make of the control messages they receive.

Each driver turns ``(message type, header)`` into one record before it dispatches
with ``match``: a header its record refuses is a ProtocolError (counted and dropped by
the receive loop), a type the receiver does not expect is None.
"""

from __future__ import annotations

import pytest

from zps.client.inbound import from_broker as client_reads
from zps.errors import ProtocolError
from zps.protocol.codec import MsgType
from zps.protocol.messages import (
    Assign,
    Heartbeat,
    HelloAgain,
    LeaseEcho,
    MapUpdate,
    RegisterAgain,
    Role,
    SnapshotAck,
    StreamAck,
    Subscribe,
)
from zps.shard.links import from_broker as shard_reads
from zps.shard.primary import _from_replica as primary_reads


def test_a_shard_reads_the_brokers_control_messages_as_records() -> None:
    assign = Assign(Role.REPLICA, 1, 4, "s-p", "tcp://h:1", "", 2)
    assert shard_reads(MsgType.ASSIGN, assign.to_wire()) == assign
    assert shard_reads(MsgType.MAP, {"map": {"version": 1}}) == MapUpdate({"version": 1})
    echo = LeaseEcho(2.5, Role.PRIMARY, 0, 3)
    assert shard_reads(MsgType.HEARTBEAT, echo.to_wire()) == echo
    assert shard_reads(MsgType.HEARTBEAT, {}) == Heartbeat()  # the broker's probe
    assert shard_reads(MsgType.REGISTER, {}) == RegisterAgain()
    for mtype in (MsgType.HELLO, MsgType.STATUS, MsgType.SUBSCRIBE, MsgType.REPLY):
        assert shard_reads(mtype, {}) is None


@pytest.mark.parametrize(
    ("mtype", "header"),
    [
        (MsgType.ASSIGN, {"role": "king"}),
        (MsgType.ASSIGN, {"role": "primary", "partition": "0"}),
        (MsgType.MAP, {}),
        (MsgType.HEARTBEAT, {"role": "primary", "t": "then"}),
    ],
)
def test_a_bad_control_header_from_the_broker_is_a_protocol_error(
    mtype: MsgType, header: dict[str, object]
) -> None:
    with pytest.raises(ProtocolError):
        shard_reads(mtype, header)


def test_a_client_reads_the_brokers_control_messages_as_records() -> None:
    assert client_reads(MsgType.MAP, {"map": {}}) == MapUpdate({})
    assert client_reads(MsgType.HELLO, {}) == HelloAgain()
    assert client_reads(MsgType.HEARTBEAT, {}) == Heartbeat()
    assert client_reads(MsgType.ASSIGN, {"role": "primary"}) is None
    with pytest.raises(ProtocolError):
        client_reads(MsgType.MAP, {"map": [1]})


def test_a_primary_reads_its_replicas_messages_as_records() -> None:
    assert primary_reads(MsgType.SUBSCRIBE, {"partition": 1, "epoch": 2}) == Subscribe(1, 2)
    ack = {"lsn": 9, "epoch": 2, "base": 4}
    assert primary_reads(MsgType.ACK, ack) == StreamAck(9, 2, 4)
    assert primary_reads(MsgType.SNAPSHOT_ACK, {"id": 1, "seq": 0}) == SnapshotAck(1, 0)
    assert primary_reads(MsgType.REPLICATE, {"prev": 0, "lsn": 1}) is None
    with pytest.raises(ProtocolError):
        primary_reads(MsgType.ACK, {"lsn": "9", "epoch": 2})
