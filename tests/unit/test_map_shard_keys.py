"""MAP's ``shard_keys`` (broker -> shards under CURVE): each shard name's registered key."""

from __future__ import annotations

import pytest

from zps.errors import ProtocolError
from zps.protocol.messages import MapUpdate


def test_shard_keys_go_with_the_map_to_shards_only_when_there_are_some() -> None:
    m = {"version": 3}
    assert MapUpdate(m).to_wire() == {"map": m}
    assert MapUpdate(m, {}).to_wire() == {"map": m}
    wire = MapUpdate(m, {"s-beta": "K" * 40}).to_wire()
    assert MapUpdate.parse(wire) == MapUpdate(m, {"s-beta": "K" * 40})
    assert MapUpdate.parse({"map": m}).shard_keys is None


@pytest.mark.parametrize("bad", [["s-beta"], {"s-beta": 1}, {2: "K" * 40}])
def test_bad_shard_keys_are_named(bad: object) -> None:
    with pytest.raises(ProtocolError, match="shard_keys"):
        MapUpdate.parse({"map": {}, "shard_keys": bad})
