"""The client's session timer under uvloop: a wake-up already due must not break it.

uvloop's ``call_at`` with a time already past schedules a plain ``Handle`` (no
``when()``); the client used to read ``when()`` of its pending timer, so a second
wake-up planned before the first had run raised AttributeError and killed the
client's flush loop: every later call hung (seen as a worker stuck after a broker
restart, whose re-sent calls made the session due at once).
"""

from __future__ import annotations

import asyncio

import pytest

from zps.client.timer import SessionTimer

uvloop = pytest.importorskip("uvloop")


def test_a_wakeup_already_due_twice_is_scheduled_once() -> None:
    async def scenario() -> tuple[float, list[float | None]]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        wakeups = iter([now - 1.0, now - 0.5, now - 2.0])
        ticks: list[float | None] = []  # the tick each flush was due
        timer = SessionTimer(lambda: loop, lambda: next(wakeups), lambda: ticks.append(tick_at()))

        def tick_at() -> float | None:
            return timer.tick_at

        timer.schedule()  # a Handle under uvloop: the time has passed
        timer.schedule()  # later than the pending one: kept
        timer.schedule()  # sooner: replaces it
        await asyncio.sleep(0.01)
        return now, ticks

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        now, ticks = runner.run(scenario())
    assert ticks == [now - 2.0]  # only the soonest wake-up fired; the first was cancelled
