"""Typed control messages and the broker's acceptance rules.

Every record round-trips through its wire header; any header at all parses into a
record or raises ProtocolError, never anything else; and :func:`accept` decides what
the broker does with a message from its frames and the membership alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zps.broker.acceptance import (
    COMMIT_TARGET,
    BadClientRequest,
    CommitReply,
    ForwardReply,
    FromClient,
    FromShard,
    Reject,
    RouteRequest,
    accept,
)
from zps.errors import ProtocolError
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import (
    Assign,
    Bye,
    ClientHello,
    ClockRequest,
    Heartbeat,
    HelloAgain,
    JobSettings,
    LeaseEcho,
    MapUpdate,
    Mode,
    RegisterAgain,
    Replicate,
    Role,
    ShardClaim,
    ShardHeartbeat,
    ShardRegister,
    SnapshotAck,
    SnapshotChunk,
    Status,
    StatusReply,
    StatusRequest,
    StreamAck,
    Subscribe,
    TaskRequest,
)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KEY = "k" * 40  # a Z85 CURVE public key is 40 characters
CLAIM = ShardClaim(partition=1, epoch=7, role=Role.REPLICA, lsn=42, in_sync=True)

RECORDS: list[Any] = [
    ShardClaim(0, 0, Role.PRIMARY),
    CLAIM,
    ShardRegister(),
    ShardRegister("h", 12, "tcp://127.0.0.1:5000", CLAIM, 42, KEY),
    ShardRegister("h", 12, "tcp://127.0.0.1:5000", None, 0, refused=(3, 7)),
    ShardHeartbeat(),
    ShardHeartbeat(t=12.5, lsn=3, epoch=2, stats={"requests": 1}, in_sync=("s-a", "s-b")),
    ShardHeartbeat(t=1.0, new_link=True),
    ClientHello(),
    ClientHello("host", 77, "worker-1"),
    Heartbeat(),
    Heartbeat(relinked=(0, 3)),
    StatusRequest(),
    Bye(),
    Bye("stream stopped"),
    ClockRequest("join", Mode.SYNC),
    ClockRequest("tick", Mode.SSP, tau=2, finished=5),
    ClockRequest("leave"),
    TaskRequest("create", "job", settings=JobSettings(100, 10, 2, 3, 9)),
    TaskRequest("next", "job"),
    TaskRequest("next", "job", wait=False),
    TaskRequest("done", "job", task=3),
    TaskRequest("release", "job", task=0),
    Assign(Role.SPARE, None, 0),
    Assign(Role.REPLICA, 1, 4, "s-p", "tcp://h:1", KEY, 2),
    LeaseEcho(1.5, Role.PRIMARY, 0, 3),
    LeaseEcho(None, Role.SPARE, None, 0),
    MapUpdate({"version": 3, "partitions": []}),
    StatusReply(Status.NOT_PRIMARY, "the primary stepped down"),
    StatusReply(Status.OK),
    RegisterAgain(),
    HelloAgain(),
    Subscribe(None, 0),
    Subscribe(3, 5, abandoned=2),
    Subscribe(3, 5, host="boot-id/4026531836"),
    Subscribe(3, 5, checksums=("XXH3-128", "SHA-256")),
    StreamAck(10, 2),
    StreamAck(10, 2, base=-1),
    StreamAck(12, 2, base=8),
    Replicate(4, 5),
    Replicate(4, 5, True),
    SnapshotChunk(1, 0, 3, 2_500, 1_000, 42),
    SnapshotAck(1, 2),
]
PARSERS: list[Callable[[Any], Any]] = [
    ShardClaim.parse,
    ShardRegister.parse,
    ShardHeartbeat.parse,
    ClientHello.parse,
    Heartbeat.parse,
    StatusRequest.parse,
    Bye.parse,
    ClockRequest.parse,
    TaskRequest.parse,
    Assign.parse,
    LeaseEcho.parse,
    MapUpdate.parse,
    StatusReply.parse,
    RegisterAgain.parse,
    HelloAgain.parse,
    Subscribe.parse,
    StreamAck.parse,
    Replicate.parse,
    SnapshotChunk.parse,
    SnapshotAck.parse,
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_its_wire_header(record: Any) -> None:
    wire = record.to_wire()
    # what travels is msgpack: tuples come back as lists, str enums as str
    back = msgpack.unpackb(msgpack.packb(wire), raw=False)
    assert type(record).parse(back) == record


def test_every_record_type_is_covered() -> None:
    assert {type(r) for r in RECORDS} == {p.__self__ for p in PARSERS}  # type: ignore[attr-defined]


def test_the_wire_keys_stay_those_the_peers_speak() -> None:
    # shards and clients read and write these keys: they are the protocol
    assert set(ShardRegister().to_wire()) == {
        "host",
        "pid",
        "address",
        "claim",
        "lsn",
        "public_key",
        "zone",
        "version",
        "incarnation",
    }
    assert set(ClientHello().to_wire()) == {"host", "pid", "name", "version"}
    assert set(ShardHeartbeat(in_sync=()).to_wire()) == {"t", "lsn", "epoch", "stats", "in_sync"}
    assert set(LeaseEcho(1.0, Role.PRIMARY, 0, 1).to_wire()) == {"t", "role", "partition", "epoch"}
    assert set(Assign(Role.SPARE, None, 0).to_wire()) == {
        "role",
        "partition",
        "epoch",
        "primary",
        "primary_address",
        "primary_key",
        "n_partitions",
    }
    assert StatusReply(Status.BAD_REQUEST, "x").to_wire() == {"st": "BAD_REQUEST", "msg": "x"}
    # between shards: replicas and primaries of different versions talk these
    assert Subscribe(1, 2).to_wire() == {"partition": 1, "epoch": 2}
    assert set(Subscribe(1, 2, 7).to_wire()) == {"partition", "epoch", "abandoned"}
    assert Subscribe(1, 2, host="h").to_wire() == {"partition": 1, "epoch": 2, "host": "h"}
    assert Subscribe(1, 2, checksums=("XXH3-128",)).to_wire()["checksums"] == ["XXH3-128"]
    assert Subscribe.parse({"partition": 1, "epoch": 2}).checksums == ()  # an earlier release
    for bad in ("XXH3-128", ["x" * 33], [1], ["a"] * 9):
        with pytest.raises(ProtocolError, match="SUBSCRIBE checksums"):
            Subscribe.parse({"partition": 1, "epoch": 2, "checksums": bad})
    assert StreamAck(5, 2, 3).to_wire() == {"lsn": 5, "epoch": 2, "base": 3}
    assert Replicate(4, 5).to_wire() == {"prev": 4, "lsn": 5}
    assert Replicate(4, 5, True).to_wire() == {"prev": 4, "lsn": 5, "ok": True}
    assert Replicate.parse({"prev": 4, "lsn": 5, "ok": True}).checked
    assert not Replicate.parse({"prev": 4, "lsn": 5, "ok": 1}).checked  # only true is
    assert set(SnapshotChunk(1, 0, 1, 1, 1, 0).to_wire()) == {
        "id",
        "seq",
        "count",
        "total",
        "chunk",
        "lsn",
    }
    assert SnapshotAck(1, 2).to_wire() == {"id": 1, "seq": 2}
    assert RegisterAgain().to_wire() == HelloAgain().to_wire() == {}


def test_a_register_public_key_that_is_not_a_z85_key_is_dropped() -> None:
    for key in ("short", "k" * 900_000, 3, [KEY]):
        assert ShardRegister.parse({"public_key": key}).public_key is None
    assert ShardRegister.parse({"public_key": KEY}).public_key == KEY


def test_missing_optional_fields_take_their_defaults() -> None:
    assert ShardRegister.parse({"host": "barrier"}) == ShardRegister(host="barrier")
    assert ShardHeartbeat.parse({}) == ShardHeartbeat()
    assert ClientHello.parse({}) == ClientHello()
    assert ClockRequest.parse({"op": "join"}) == ClockRequest("join", Mode.ASYNC, 0)
    assert TaskRequest.parse({"op": "create", "job": "j"}).settings == JobSettings()


@pytest.mark.parametrize(
    ("parse", "header", "words"),
    [
        (ShardRegister.parse, {"pid": "12"}, "pid"),
        (ShardRegister.parse, {"pid": True}, "pid"),
        (ShardRegister.parse, {"claim": [1]}, "claim"),
        (ShardRegister.parse, {"claim": {"partition": 0, "epoch": 1, "role": "king"}}, "role"),
        (ShardRegister.parse, {"claim": {"partition": -1, "epoch": 1, "role": "spare"}}, "part"),
        (ShardRegister.parse, {"claim": {"epoch": 1, "role": "spare"}}, "partition"),
        (ShardHeartbeat.parse, {"t": "marker"}, "send time"),
        (ShardHeartbeat.parse, {"t": 3}, "send time"),
        (ShardHeartbeat.parse, {"t": float("nan")}, "send time"),
        (LeaseEcho.parse, {"t": float("inf"), "role": "spare"}, "send time"),
        (ShardHeartbeat.parse, {"in_sync": ["s-a", 3]}, "in_sync"),
        (ShardHeartbeat.parse, {"epoch": -1}, "epoch"),
        (ShardHeartbeat.parse, {"stats": []}, "stats"),
        (Heartbeat.parse, {"relinked": 3}, "relinked"),
        (Heartbeat.parse, {"relinked": [0, "1"]}, "relinked"),
        (ClientHello.parse, {"host": 3}, "host"),
        (ClockRequest.parse, {"op": "jump"}, "clock operation"),
        (ClockRequest.parse, {"op": "join", "mode": "fast"}, "mode"),
        (ClockRequest.parse, {"op": "join", "mode": ["sync"]}, "mode"),
        (ClockRequest.parse, {"op": "join", "tau": -1}, "staleness"),
        (ClockRequest.parse, {"op": "tick"}, "finished"),
        (TaskRequest.parse, {"op": "next"}, "job name"),
        (TaskRequest.parse, {"op": "next", "job": ""}, "job name"),
        (TaskRequest.parse, {"op": "next", "job": "j", "wait": 0}, "wait"),
        (TaskRequest.parse, {"op": "create", "job": "j", "epochs": 1.0}, "integers"),
        (TaskRequest.parse, {"op": "done", "job": "j", "task": "1"}, "task id"),
        (TaskRequest.parse, {"op": "steal", "job": "j"}, "task operation"),
        (Assign.parse, {"role": "spare", "partition": "0"}, "partition"),
        (Assign.parse, {}, "role"),
        (LeaseEcho.parse, {"t": 1.0}, "role"),
        (MapUpdate.parse, {"map": 3}, "map"),
        (StatusReply.parse, {"st": "WHATEVER"}, "status"),
        (Subscribe.parse, {"partition": 0}, "epoch"),
        (Subscribe.parse, {"partition": "0", "epoch": 1}, "partition"),
        (Subscribe.parse, {"partition": 0, "epoch": 1, "abandoned": 1.5}, "abandoned"),
        (Subscribe.parse, {"partition": 0, "epoch": 1, "host": 7}, "host"),
        (Subscribe.parse, {"partition": 0, "epoch": 1, "host": "h" * 300}, "host"),
        (StreamAck.parse, {"epoch": 1}, "lsn"),
        (StreamAck.parse, {"lsn": True, "epoch": 1}, "lsn"),
        (StreamAck.parse, {"lsn": 3}, "epoch"),
        (StreamAck.parse, {"lsn": 3, "epoch": 1, "base": -2}, "base"),
        (Replicate.parse, {"lsn": 3}, "prev"),
        (Replicate.parse, {"prev": 2, "lsn": "3"}, "lsn"),
        (SnapshotChunk.parse, {"id": 1, "seq": 0, "count": 1, "total": 1, "chunk": 1}, "lsn"),
        (SnapshotChunk.parse, {"id": 1, "seq": -1, "count": 1, "total": 1, "chunk": 1}, "seq"),
        (SnapshotAck.parse, {"id": "1", "seq": 0}, "id"),
        (SnapshotAck.parse, {"id": 1}, "seq"),
    ],
)
def test_a_bad_field_is_a_protocol_error_naming_it(
    parse: Callable[[Any], Any], header: dict[str, Any], words: str
) -> None:
    with pytest.raises(ProtocolError, match=words):
        parse(header)


# -- garbage in -> record or ProtocolError ------------------------------------------

KNOWN_KEYS = sorted(
    {k for r in RECORDS for k in r.to_wire()}
    | {"op", "job", "mode", "tau", "finished", "wait", "task", "msg", "st", "claim"}
)
PLAUSIBLE = [
    "primary",
    "replica",
    "spare",
    "join",
    "tick",
    "leave",
    "create",
    "next",
    "done",
    "release",
    "sync",
    "ssp",
    "async",
    "OK",
    KEY,
]
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from([-1, 0, 1, 2, 2**31, 2**32, 2**64 - 1])
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(PLAUSIBLE)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=12,
)
headers = st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), values, max_size=8)


@FAST
@given(parse=st.sampled_from(PARSERS), header=headers)
def test_a_garbage_header_parses_or_raises_protocol_error_only(
    parse: Callable[[Any], Any], header: dict[str, Any]
) -> None:
    try:
        record = parse(header)
    except ProtocolError:
        return
    # what parsed is a record that travels back unchanged
    assert type(record).parse(record.to_wire()) == record


@FAST
@given(parse=st.sampled_from(PARSERS), header=values)
def test_a_header_that_is_not_even_a_map_is_still_only_a_protocol_error(
    parse: Callable[[Any], Any], header: Any
) -> None:
    if isinstance(header, dict):
        return
    with pytest.raises(ProtocolError):
        ShardClaim.parse(header)
    with contextlib.suppress(ProtocolError):
        parse({"claim": header, "in_sync": header, "stats": header, "map": header})


# -- the acceptance rules --------------------------------------------------------------


@dataclass
class Members:
    """A membership for the rules: registered shards and the primaries."""

    shards: set[str] = field(default_factory=set)
    primaries: dict[int, str] = field(default_factory=dict)

    def primary_of(self, partition: int) -> str | None:
        return self.primaries.get(partition)


NOBODY = Members()
SHARD = b"s-one"
CLIENT = b"c-one"


def control(mtype: MsgType, header: dict[str, Any], req_id: int = 0) -> list[bytes]:
    return encode(Route(mtype, req_id=req_id), header)


def test_a_client_request_is_routed_on_its_route_frame_alone() -> None:
    route = Route(MsgType.REQUEST, 1, 4, 99)
    assert accept(CLIENT, [route.pack()], NOBODY) == RouteRequest(route)
    assert accept(CLIENT, [route.pack(), b"\xc1not msgpack"], NOBODY) == RouteRequest(route)


@pytest.mark.parametrize(
    ("mtype", "header", "message"),
    [
        (MsgType.HELLO, {"host": "h", "pid": 3, "name": "w"}, ClientHello("h", 3, "w")),
        (MsgType.HEARTBEAT, {"anything": [1]}, Heartbeat()),
        (MsgType.STATUS, {}, StatusRequest()),
        (MsgType.BYE, {}, Bye()),
        (MsgType.CLOCK, {"op": "leave"}, ClockRequest("leave")),
        (MsgType.TASK, {"op": "next", "job": "j"}, TaskRequest("next", "j")),
    ],
)
def test_a_client_may_send_its_control_messages(
    mtype: MsgType, header: dict[str, Any], message: Any
) -> None:
    verdict = accept(CLIENT, control(mtype, header, 5), NOBODY)
    assert verdict == FromClient(Route(mtype, req_id=5), message)


@pytest.mark.parametrize(
    "mtype",
    [
        MsgType.REPLY,
        MsgType.MAP,
        MsgType.REGISTER,
        MsgType.ASSIGN,
        MsgType.SUBSCRIBE,
        MsgType.SNAPSHOT,
        MsgType.REPLICATE,
        MsgType.ACK,
    ],
)
def test_a_client_may_not_send_what_only_the_broker_or_shards_send(mtype: MsgType) -> None:
    verdict = accept(CLIENT, control(mtype, {"role": "primary", "partition": 0}), NOBODY)
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"
    assert mtype.name in verdict.reason


def test_a_bad_clock_or_task_request_is_answered_not_dropped() -> None:
    verdict = accept(CLIENT, control(MsgType.CLOCK, {"op": "join", "tau": -1}, 8), NOBODY)
    assert isinstance(verdict, BadClientRequest) and verdict.route.req_id == 8
    assert "staleness" in verdict.error
    verdict = accept(CLIENT, control(MsgType.TASK, {"op": "next"}), NOBODY)
    assert isinstance(verdict, BadClientRequest)


def test_a_bad_hello_is_malformed() -> None:
    verdict = accept(CLIENT, control(MsgType.HELLO, {"pid": "7"}), NOBODY)
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"short"],
        [Route(MsgType.HELLO).pack()],  # no header
        [Route(MsgType.HELLO).pack(), b"\xc1"],
        [Route(MsgType.HELLO).pack(), msgpack.packb([1, 2])],
    ],
)
def test_a_client_message_that_does_not_decode_is_malformed(frames: list[bytes]) -> None:
    verdict = accept(CLIENT, frames, NOBODY)
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"


@pytest.mark.parametrize(
    ("mtype", "header", "message"),
    [
        (MsgType.REGISTER, {"address": ""}, ShardRegister()),
        (MsgType.HEARTBEAT, {"t": 2.5, "lsn": 4}, ShardHeartbeat(t=2.5, lsn=4)),
        (MsgType.BYE, {}, Bye()),
    ],
)
def test_a_shard_may_send_its_control_messages(
    mtype: MsgType, header: dict[str, Any], message: Any
) -> None:
    verdict = accept(SHARD, [b"", *control(mtype, header)], NOBODY)
    assert verdict == FromShard(Route(mtype), message)


@pytest.mark.parametrize(
    "mtype", [MsgType.HELLO, MsgType.STATUS, MsgType.CLOCK, MsgType.ASSIGN, MsgType.MAP]
)
def test_a_shard_may_not_send_the_broker_other_types(mtype: MsgType) -> None:
    verdict = accept(SHARD, [b"", *control(mtype, {"op": "join"})], NOBODY)
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"


def test_a_shard_message_without_target_and_route_is_malformed() -> None:
    for frames in ([b""], [Route(MsgType.HEARTBEAT).pack()]):
        verdict = accept(SHARD, frames, Members({"s-one"}))
        assert isinstance(verdict, Reject) and verdict.counter == "malformed"


def test_a_registered_shard_replies_to_clients_only() -> None:
    members = Members({"s-one"})
    reply = encode(Route(MsgType.REPLY, 0, 1, 3), {"st": "OK"})
    assert accept(SHARD, [CLIENT, *reply], members) == ForwardReply(CLIENT)
    # a "reply" to another shard would forge the broker's control messages
    forged = encode(Route(MsgType.ASSIGN), {"role": "spare", "partition": None})
    verdict = accept(SHARD, [b"s-two", b"", *forged], members)
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"


def test_a_reply_from_a_shard_declared_dead_is_stale() -> None:
    reply = encode(Route(MsgType.REPLY, 0, 1, 3), {"st": "OK"})
    verdict = accept(SHARD, [CLIENT, *reply], NOBODY)
    assert isinstance(verdict, Reject) and verdict.counter == "stale_replies"


def test_a_commit_answer_counts_only_from_the_current_primary() -> None:
    route = Route(MsgType.REPLY, 1, 2, 7)
    answer = [COMMIT_TARGET, *encode(route, {"st": "OK", "res": [{"st": "OK"}]})]
    members = Members({"s-one"}, {1: "s-one"})
    assert accept(SHARD, answer, members) == CommitReply(route, {"st": "OK", "res": [{"st": "OK"}]})
    deposed = accept(SHARD, answer, Members({"s-one"}, {1: "s-new"}))
    assert isinstance(deposed, Reject) and deposed.counter is None
    garbled = accept(SHARD, [COMMIT_TARGET, b"junk"], members)
    assert isinstance(garbled, Reject) and garbled.counter == "malformed"


def test_an_identity_without_the_shard_prefix_is_a_client() -> None:
    frames = [b"", *control(MsgType.REGISTER, {})]  # a shard's framing from a client
    verdict = accept(b"x-s-one", frames, Members({"x-s-one"}))
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"


frame_lists = st.lists(
    st.binary(max_size=24)
    | st.sampled_from([b"", COMMIT_TARGET, CLIENT, SHARD, *(Route(t).pack() for t in MsgType)])
    | headers.map(msgpack.packb),
    max_size=5,
)


@FAST
@given(ident=st.sampled_from([CLIENT, SHARD, b"", b"s-"]), frames=frame_lists)
def test_accept_never_raises_on_any_frames(ident: bytes, frames: list[bytes]) -> None:
    members = Members({"s-one"}, {0: "s-one", -1: "s-one"})
    verdict = accept(ident, frames, members)
    assert isinstance(
        verdict,
        RouteRequest
        | FromClient
        | BadClientRequest
        | FromShard
        | ForwardReply
        | CommitReply
        | Reject,
    )


@pytest.mark.parametrize("bad", [[1], [1, 2, 3], ["a", 1], [True, 1], 5, "0,1"])
def test_a_register_names_a_refused_role_as_partition_and_epoch(bad: Any) -> None:
    with pytest.raises(ProtocolError, match="REGISTER refused"):
        ShardRegister.parse({"refused": bad})
    assert ShardRegister.parse({"refused": [2, 5]}).refused == (2, 5)
    assert "refused" not in ShardRegister().to_wire()  # absent, as from older shards
