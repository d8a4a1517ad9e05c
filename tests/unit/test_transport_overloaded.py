"""OVERLOADED: the broker's refusal of a request it cannot pass on to a busy shard."""

from __future__ import annotations

import numpy as np
import pytest

from zps.client.session import ClientSession, Send
from zps.core.routing import ClusterMap, PartitionInfo
from zps.errors import OverloadedError, RemoteError, remote_error
from zps.protocol.codec import Encoder, Message, MsgType, Route, decode
from zps.protocol.messages import Status, StatusReply


def test_the_status_travels_and_maps_to_its_error() -> None:
    wire = StatusReply(Status.OVERLOADED, "busy").to_wire()
    assert StatusReply.parse(wire) == StatusReply(Status.OVERLOADED, "busy")
    err = remote_error(wire["st"], wire["msg"])
    assert isinstance(err, OverloadedError) and isinstance(err, RemoteError)
    assert err.code == "OVERLOADED" and str(err) == "busy"


def test_the_client_retries_an_overloaded_request_with_backoff() -> None:
    parts = {p: PartitionInfo(epoch=1, primary="s-a", lost=False) for p in range(2)}
    s: ClientSession[str] = ClientSession(b"c-test", timeout=5.0, max_backoff=0.5)
    s.on_map(ClusterMap(1, 16, np.zeros(16, dtype=np.int32), parts, "b1"), 0.0)
    enc = Encoder()
    desc = enc.array(np.arange(3, dtype=np.int64))
    (first,) = s.submit(0, [{"op": "pull_rows", "t": "emb", "ids": desc}], enc, "tok", 0.0)
    assert isinstance(first, Send)
    req_id = decode(first.frames).route.req_id
    refusal = Message(
        Route(MsgType.REPLY, 0, 1, req_id), StatusReply(Status.OVERLOADED).to_wire(), []
    )
    assert s.on_reply(refusal, 1.0) == []  # parked, not failed
    assert s.next_wakeup() == pytest.approx(1.01)
    (again,) = s.tick(1.01)
    assert isinstance(again, Send)
    assert decode(again.frames).route.req_id == req_id
