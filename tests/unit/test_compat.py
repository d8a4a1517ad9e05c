"""The compatibility rule of docs/design.md ("Versions"): within one protocol version a
newer release may add header keys, and an older peer ignores the keys it does not know;
across protocol versions the route frame's first bytes still tell the versions apart."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from test_messages import RECORDS

from zps.protocol.codec import MAGIC, PROTOCOL_VERSION, ROUTE


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_newer_release_s_extra_header_keys_are_ignored(record: Any) -> None:
    wire = dict(record.to_wire())
    wire["added_by_a_newer_release"] = {"any": ["value", 1, 2.5]}
    wire["zz"] = None
    back = msgpack.unpackb(msgpack.packb(wire), raw=False)
    assert type(record).parse(back) == record


def test_the_version_sits_where_every_version_finds_it() -> None:
    """``ZP`` and the version open every route frame: an older or newer peer reads both."""
    frame = ROUTE.pack(MAGIC, PROTOCOL_VERSION, 1, -1, 0, 7)
    assert frame[:2] == b"ZP" == MAGIC and frame[2] == PROTOCOL_VERSION
    other = ROUTE.pack(MAGIC, PROTOCOL_VERSION + 1, 1, -1, 0, 7)
    assert other[:2] == b"ZP" and other[2] == PROTOCOL_VERSION + 1
