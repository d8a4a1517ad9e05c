"""The edge of a CURVE server (zps.transport.peers): which connection stands for which
zps id, and the ZAP reply metadata that gives each connection a handle no peer chose."""

from __future__ import annotations

import struct

import pytest

from zps.transport.curve import new_handle, zap_metadata, zmtp_property
from zps.transport.peers import PeerTable, is_handle


def test_a_claim_binds_only_once_accepted() -> None:
    t = PeerTable()
    t.seen(b"z-1", 7)  # a message came (and was refused): nothing bound
    assert t.route(b"c-a") is None and len(t) == 0
    t.accepted(b"c-a", b"z-1", 7)
    assert t.route(b"c-a") == b"z-1" and len(t) == 1


def test_the_newest_accepted_message_wins() -> None:
    t = PeerTable()
    t.accepted(b"c-a", b"z-1", 7)
    t.accepted(b"c-a", b"z-2", 9)  # its key spoke again, on another connection
    assert t.route(b"c-a") == b"z-2"
    assert t.closed(7) is None  # the earlier connection's close is not its
    assert t.route(b"c-a") == b"z-2"
    assert t.closed(9) == b"c-a" and t.route(b"c-a") is None and len(t) == 0


def test_a_close_drops_only_that_connections_binding() -> None:
    t = PeerTable()
    t.accepted(b"c-a", b"z-1", 7)
    t.accepted(b"c-b", b"z-2", 8)
    assert t.closed(7) == b"c-a"
    assert t.route(b"c-a") is None and t.route(b"c-b") == b"z-2"
    assert t.closed(7) is None  # told twice: nothing more


def test_a_connection_holds_one_binding() -> None:
    t = PeerTable()
    t.accepted(b"c-a", b"z-1", 7)
    t.accepted(b"c-b", b"z-1", 7)  # another zps id accepted on that connection
    assert t.route(b"c-a") is None and t.route(b"c-b") == b"z-1" and len(t) == 1


def test_a_reused_descriptor_keeps_the_new_connections_binding() -> None:
    """The descriptor of a closed connection is reused before its close is reported:
    the late report drops nothing of the new connection's."""
    t = PeerTable()
    t.seen(b"z-1", 7)
    t.accepted(b"c-a", b"z-1", 7)
    t.seen(b"z-2", 7)  # a new connection on fd 7: the old one closed
    assert t.route(b"c-a") is None  # stale: its connection is gone
    t.accepted(b"c-a", b"z-2", 7)
    assert t.closed(7) is None  # the old connection's close, reported late
    assert t.route(b"c-a") == b"z-2"
    assert t.closed(7) == b"c-a" and t.route(b"c-a") is None


def test_the_table_is_bounded_by_open_connections() -> None:
    t = PeerTable()
    for i in range(1000):  # one connection after another on the same descriptors
        fd = 10 + i % 4
        handle = b"z-%d" % i
        t.seen(handle, fd)
        t.accepted(b"c-x-%d" % i, handle, fd)
    assert len(t) == 4
    for fd in range(10, 14):
        t.closed(fd)
    assert len(t) <= 4


def test_handles_are_what_no_other_peer_can_present() -> None:
    assert is_handle(b"z-abc", b"z-abc")
    assert is_handle(b"p-" + b"0" * 32, b"z-abc")  # the peer's own secret won the race
    assert not is_handle(b"\x00\x6b\x8b\x45\x68", b"z-abc")  # libzmq generated it
    assert not is_handle(b"c-0123456789abcdef-x", b"z-abc")  # chosen by the peer
    assert not is_handle(b"p-", None) and not is_handle(b"z-abc", None)


def test_zap_metadata_sets_the_identity_property() -> None:
    handle = new_handle()
    assert handle.startswith(b"z-") and len(handle) == 34 and new_handle() != handle
    meta = zap_metadata(handle)
    assert meta[0] == len(b"Identity") and meta[1:9] == b"Identity"
    assert struct.unpack(">I", meta[9:13])[0] == len(handle) and meta[13:] == handle
    assert zmtp_property(b"X", b"") == b"\x01X\x00\x00\x00\x00"
    with pytest.raises(ValueError, match="1-255 bytes"):
        zmtp_property(b"", b"v")
    with pytest.raises(ValueError, match="1-255 bytes"):
        zmtp_property(b"n" * 256, b"v")


def test_a_connections_metadata_is_known_until_it_closes() -> None:
    t = PeerTable()
    assert t.known(b"z-1") is None
    t.learn(b"z-1", b"c-a", 7)
    assert t.known(b"z-1") == (b"c-a", 7)
    t.learn(b"z-2", b"c-b", 7)  # a new connection on fd 7: the old one closed
    assert t.known(b"z-1") is None and t.known(b"z-2") == (b"c-b", 7)
    assert t.closed(7) is None  # the old connection's close, reported late
    assert t.known(b"z-2") == (b"c-b", 7)
    t.closed(7)
    assert t.known(b"z-2") is None
    t.learn(b"z-3", b"c-c", None)  # no descriptor: nothing to forget it by, not kept
    assert t.known(b"z-3") is None
