"""What a routing broker posted to each shard and has no reply for
(:mod:`zps.broker.forwarded`), and the router refusing it when the shard's link is
lost or made again."""

from __future__ import annotations

import pytest

from zps.broker.forwarded import Forwarded
from zps.protocol.codec import MsgType, Route


def req(req_id: int, partition: int = 0) -> Route:
    return Route(MsgType.REQUEST, partition, 1, req_id)


def test_a_request_is_remembered_until_its_reply_passes_back() -> None:
    f = Forwarded()
    f.posted(b"s-a", b"c-1", req(1))
    f.posted(b"s-a", b"c-1", req(2))
    f.posted(b"s-a", b"c-2", req(1))
    assert len(f) == 3
    f.answered(b"s-a", b"c-1", 1)
    f.answered(b"s-a", b"c-1", 1)  # a second reply (parts, duplicates) changes nothing
    f.answered(b"s-b", b"c-1", 2)  # another shard's reply is not this one's
    assert len(f) == 2
    assert f.lost(b"s-a") == [(b"c-1", req(2)), (b"c-2", req(1))]
    assert len(f) == 0
    assert f.lost(b"s-a") == []


def test_a_lost_link_hands_back_only_its_shards_requests() -> None:
    f = Forwarded()
    f.posted(b"s-a", b"c-1", req(1, 0))
    f.posted(b"s-b", b"c-1", req(2, 1))
    assert f.lost(b"s-b") == [(b"c-1", req(2, 1))]
    assert f.shards() == [b"s-a"]
    assert len(f) == 1


def test_a_request_posted_again_is_remembered_once_as_the_newest() -> None:
    f = Forwarded()
    f.posted(b"s-a", b"c-1", req(1))
    f.posted(b"s-a", b"c-1", req(2))
    f.posted(b"s-a", b"c-1", req(1))
    assert len(f) == 2
    assert [r.req_id for _, r in f.lost(b"s-a")] == [2, 1]


def test_the_bound_forgets_the_oldest_and_counts_it() -> None:
    f = Forwarded(limit=3)
    for i in range(3):
        f.posted(b"s-a", b"c", req(i))
    f.posted(b"s-b", b"c", req(10))  # s-b holds nothing: the largest shard gives one up
    f.posted(b"s-a", b"c", req(3))
    assert len(f) == 3
    assert f.forgotten == 2
    assert [r.req_id for _, r in f.lost(b"s-a")] == [2, 3]
    assert [r.req_id for _, r in f.lost(b"s-b")] == [10]


def test_a_client_id_given_as_a_bytes_subclass_is_kept_as_bytes() -> None:
    class PeerId(bytes):
        pass

    f = Forwarded()
    f.posted(b"s-a", PeerId(b"c-1"), req(1))
    f.answered(PeerId(b"s-a"), b"c-1", 1)
    assert len(f) == 0
    f.posted(b"s-a", PeerId(b"c-1"), req(2))
    ((client, _),) = f.lost(b"s-a")
    assert type(client) is bytes


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit"):
        Forwarded(limit=0)
