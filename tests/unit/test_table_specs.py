"""Where a client asks for a table's spec (zps.client.keyvalue.KeyValue.table_spec): a
call to a partition that serves never waits for another partition that has no copy."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zps.client.keyvalue import KeyValue
from zps.core.hashing import name_hash
from zps.core.routing import ClusterMap, PartitionInfo, default_slot_map
from zps.errors import UnknownTableError
from zps.init import Zeros
from zps.optim import Adam
from zps.protocol.specs import EmbeddingSpec

SPEC = EmbeddingSpec("emb", 4, "float32", Zeros(), Adam(), 1)
N_SLOTS = 64


class Requests:
    """The partitions' answers to ``tables``; a partition without a primary never
    answers (its call waits)."""

    config: Any = None

    def __init__(self, primaries: dict[int, str | None], held: dict[int, list[Any]]) -> None:
        parts = {p: PartitionInfo(epoch=1, primary=who) for p, who in primaries.items()}
        self.cluster_map = ClusterMap(1, N_SLOTS, default_slot_map(N_SLOTS, len(parts)), parts)
        self.held = held
        self.asked: list[int] = []

    def submit(self, partition: int, body: dict[str, Any], arrays: Any, **kw: Any) -> Any:
        assert body == {"op": "tables"}
        self.asked.append(partition)
        fut = asyncio.get_running_loop().create_future()
        if self.cluster_map.partitions[partition].primary:
            fut.set_result({"tables": [s.to_wire() for s in self.held[partition]]})
        return fut


def home() -> int:
    return int(default_slot_map(N_SLOTS, 3)[name_hash("emb") % N_SLOTS])


async def test_a_spec_comes_from_a_serving_partition_while_its_own_has_no_primary() -> None:
    primaries: dict[int, str | None] = {p: f"s-{p}" for p in range(3)}
    primaries[home()] = None
    rq = Requests(primaries, {p: [SPEC] for p in range(3)})
    kv = KeyValue(rq, lambda body: body)  # type: ignore[arg-type]
    spec = await asyncio.wait_for(kv.table_spec("emb"), 5)
    assert spec == SPEC and home() not in rq.asked
    assert await kv.table_spec("emb") == SPEC and len(rq.asked) == 1  # remembered


async def test_the_partition_it_hashes_to_is_asked_while_it_serves() -> None:
    rq = Requests({p: f"s-{p}" for p in range(3)}, {p: [SPEC] for p in range(3)})
    kv = KeyValue(rq, lambda body: body)  # type: ignore[arg-type]
    assert await asyncio.wait_for(kv.table_spec("emb"), 5) == SPEC
    assert rq.asked == [home()]
    with pytest.raises(UnknownTableError, match="'nope'"):
        await asyncio.wait_for(kv.table_spec("nope"), 5)


async def test_only_the_hashed_partition_says_a_table_is_unknown() -> None:
    # Another partition without the spec (added since) is not the last word: the hashed
    # one is asked, and its call waits for it to serve.
    primaries: dict[int, str | None] = {p: f"s-{p}" for p in range(3)}
    primaries[home()] = None
    rq = Requests(primaries, {p: [] for p in range(3)})
    kv = KeyValue(rq, lambda body: body)  # type: ignore[arg-type]
    call = asyncio.ensure_future(kv.table_spec("emb"))
    for _ in range(20):
        await asyncio.sleep(0)  # turns of the loop: the answers come in them
    assert not call.done() and len(rq.asked) == 2 and rq.asked[-1] == home()
    call.cancel()
