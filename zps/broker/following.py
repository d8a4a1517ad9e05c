"""Which broker of the followed pair a routing broker talks to, and which map it takes
(pure: time is an argument).  See :mod:`zps.broker.router`."""

from __future__ import annotations


def newer(held: tuple[int, str, int] | None, got: tuple[int, str, int]) -> bool:
    """Whether a map stamped ``(term, incarnation, version)`` replaces the held one: a
    higher term, else (same term) another broker incarnation or a higher version."""
    if held is None:
        return True
    term, inc, version = got
    if term != held[0]:
        return term > held[0]
    return inc != held[1] or version > held[2]


class Leader:
    """Which broker of the followed pair the router talks to (as a client would).

    Messages go to the current one; after ``silence`` seconds without a word from it
    the next one becomes current.  A message with an older term than the highest seen
    is dropped; one with a term at least as high from the other broker makes it current.
    """

    def __init__(self, n: int, *, silence: float, now: float) -> None:
        self.n = n
        self.silence = silence
        self.current = 0
        self.term = 0
        self.switches = 0
        self._heard = now

    def heard(self, index: int, term: int | None, now: float) -> bool | None:
        """None: drop the message (an older term); True: ``index`` became current."""
        switched = False
        if term is not None:
            if term < self.term:
                return None
            self.term = term
            if index != self.current:
                self.current, self.switches, switched = index, self.switches + 1, True
        if index == self.current:
            self._heard = now
        return switched

    @property
    def last_heard(self) -> float:
        return self._heard

    def tick(self, now: float) -> bool:
        """True when the current broker changed for its silence."""
        if self.n > 1 and now - self._heard >= self.silence:
            self.current = (self.current + 1) % self.n
            self._heard = now
            self.switches += 1
            return True
        return False
