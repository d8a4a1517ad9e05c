"""When a client's session is next due a tick: one loop timer at the session's next
wake-up, replaced only by a sooner one, and the time the tick is due for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class SessionTimer:
    """``schedule`` sets the timer for ``next_wakeup()`` (if sooner than planned); when it
    fires, the tick is due (:meth:`due`) and ``on_due`` runs, which takes it (:meth:`take`)."""

    def __init__(
        self,
        loop: Callable[[], asyncio.AbstractEventLoop],
        next_wakeup: Callable[[], float | None],
        on_due: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._next_wakeup = next_wakeup
        self._on_due = on_due
        # At the session's next wake-up, ``_at``.  A plain Handle when that time had
        # passed (uvloop's call_at then schedules a call_soon, which has no when()).
        self._handle: asyncio.Handle | None = None
        self._at = 0.0
        #: The time the session is due a tick for (None: not due).
        self.tick_at: float | None = None

    def schedule(self) -> None:
        at = self._next_wakeup()
        if at is None or (self._handle is not None and self._at <= at):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop().call_at(at, self._fire, at)
        self._at = at

    def _fire(self, at: float) -> None:
        self._handle = None
        self.due(at)
        self._on_due()

    def due(self, at: float) -> None:
        """The session is due a tick for time ``at`` (the soonest asked for counts)."""
        self.tick_at = at if self.tick_at is None else min(self.tick_at, at)

    def take(self, now: float) -> float | None:
        """The time to tick the session for, if it is due (the timer may fire a hair
        early: the session is told the time it asked for), and it is not due after."""
        if self.tick_at is None:
            return None
        at = max(now, self.tick_at)
        self.tick_at = None
        return at

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
