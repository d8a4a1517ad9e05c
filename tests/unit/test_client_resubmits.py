"""What a MOVED answer sends again (zps.client.ops.Resubmits, the driver's side of
ClientSession rule 8): at once, or held back until a newer map comes or its time is up,
and failed with the client."""

from __future__ import annotations

import asyncio
from typing import Any

from zps.client.ops import Op, Resubmits
from zps.client.session import Resubmit
from zps.errors import ClosedError


def _op(loop: asyncio.AbstractEventLoop, i: int) -> Op:
    return Op({"op": "tables", "i": i}, {}, loop.create_future())


def _action(ops: list[Op], after: float) -> Resubmit[list[Op]]:
    return Resubmit(ops, 7, 0, tuple(None for _ in ops), deadline=99.0, after=after)


async def _scenario() -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    sent: list[tuple[int, int]] = []

    def submit(partition: int, body: dict[str, Any], arrays: Any, **kw: Any) -> Any:
        sent.append((partition, body["i"]))
        fut = loop.create_future()
        fut.set_result({"st": "OK"})
        return fut

    timers: list[tuple[float, Any]] = []
    r = Resubmits(submit, lambda t, f: timers.append((t, f)))
    out: dict[str, Any] = {}
    first = [_op(loop, 1)]
    r.resubmit(first, _action(first, 0.0))  # the first MOVED: at once
    out["at_once"] = list(sent)
    held = [_op(loop, 2)]
    r.resubmit(held, _action(held, 0.05))
    out["held"] = (list(sent), len(r), [t for t, _ in timers])
    r.new_map()  # a newer map: what is held goes now
    out["after_map"] = (list(sent), len(r))
    timers[0][1]()  # its timer, later: nothing left to send
    out["timer_after_map"] = list(sent)
    timed = [_op(loop, 3)]
    r.resubmit(timed, _action(timed, 0.1))
    timers[1][1]()  # no newer map: its time is up
    out["timed"] = (list(sent), len(r))
    closing = [_op(loop, 4)]
    r.resubmit(closing, _action(closing, 0.1))
    r.fail(ClosedError("the client was closed"))
    out["failed"] = closing[0].future.exception()
    timers[2][1]()
    out["after_fail"] = list(sent)
    await asyncio.sleep(0)
    out["joined"] = [op.future.done() for op in first + held + timed]
    return out


def test_resubmits_wait_for_a_newer_map_or_their_time() -> None:
    out = asyncio.run(_scenario())
    assert out["at_once"] == [(0, 1)]
    assert out["held"] == ([(0, 1)], 1, [0.05])
    assert out["after_map"] == ([(0, 1), (0, 2)], 0)
    assert out["timer_after_map"] == [(0, 1), (0, 2)]
    assert out["timed"] == ([(0, 1), (0, 2), (0, 3)], 0)
    assert isinstance(out["failed"], ClosedError)
    assert out["after_fail"] == [(0, 1), (0, 2), (0, 3)]
    assert out["joined"] == [True, True, True]
