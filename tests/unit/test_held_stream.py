"""The stream a replica holds during a snapshot (zps.shard.held): in order across memory
and the spool, read back in bounded steps, and bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from zps.protocol.codec import MsgType, Route
from zps.protocol.messages import Replicate
from zps.shard.held import HeldStream, HeldStreamFull


def message(lsn: int, size: int) -> tuple[Route, Replicate, list[bytes]]:
    route = Route(MsgType.REPLICATE, 0, 3, 0)
    return route, Replicate(lsn - 1, lsn, lsn % 2 == 0), [b"h%d" % lsn, bytes([lsn % 251]) * size]


async def test_messages_come_back_in_order_from_memory_then_the_spool(tmp_path: Path) -> None:
    held = HeldStream(memory_bytes=10_000, spool_bytes=1 << 30, folder=tmp_path)
    for lsn in range(1, 41):
        held.add(*message(lsn, 1_000))
    assert held.spooled > 0 and held.memory_held <= 10_000
    got: list[tuple[Route, Replicate, list[bytes]]] = []
    added = False
    while batch := await held.take(5_000):
        assert len(batch) <= 6  # about max_bytes at a time
        got += batch
        if len(got) >= 20 and not added:  # more arrives while it is read back: at the end
            added = True
            for lsn in range(41, 46):
                held.add(*message(lsn, 1_000))
    assert [h.lsn for _, h, _ in got] == list(range(1, 46))
    for route, header, payloads in got:
        want_route, want_header, want_payloads = message(header.lsn, 1_000)
        assert (route.mtype, route.epoch, header) == (want_route.mtype, 3, want_header)
        assert [bytes(p) for p in payloads] == want_payloads
    assert len(held) == 0 and held.held_bytes == 0
    held.close()
    assert not list(tmp_path.iterdir())  # the spool is unlinked


async def test_past_the_spool_bound_it_refuses() -> None:
    held = HeldStream(memory_bytes=1_000, spool_bytes=5_000)
    held.add(*message(1, 900))  # in memory
    with pytest.raises(HeldStreamFull, match="passed 5000 bytes"):
        for lsn in range(2, 10):
            held.add(*message(lsn, 900))
    assert 2 <= held.spooled <= 5 and held.spooled_bytes <= 5_000
    held.close()
