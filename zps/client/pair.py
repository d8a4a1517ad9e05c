"""A client's side of a broker pair: it follows the active broker, as
:class:`~zps.client.session.BrokerChoice` decides from what each broker says and from
their silence (after ``failover_timeout`` it introduces itself to the other one), and
drops what a broker replaced by a newer term says.

It needs the client's clock, ``use`` (send to broker ``index`` from now on),
``hello`` (introduce the client again) and the number of requests in flight (for the
log): nothing else of the connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from zps.client.inbound import REPLIES
from zps.client.session import BrokerChoice
from zps.protocol.codec import Message

log = logging.getLogger("zps.client")


class PairFollower:
    """Which broker of the pair the client's requests go to (see the module notes)."""

    def __init__(
        self,
        choice: BrokerChoice,
        addresses: Sequence[str],
        *,
        now: Callable[[], float],
        use: Callable[[int], None],
        hello: Callable[[], Awaitable[None]],
        in_flight: Callable[[], int],
    ) -> None:
        self.choice = choice
        self.addresses = addresses
        self._now = now
        self._use = use
        self._hello = hello
        self._in_flight = in_flight

    async def run(self) -> None:
        """Follow the active broker of the pair as time passes."""
        while True:
            await asyncio.sleep(self.choice.retry)
            what = self.choice.tick(self._now())
            if what == "switch":
                self.switch_to(self.choice.current, "the other one was silent")
            if what is not None:
                await self._hello()

    def switch_to(self, index: int, why: str) -> None:
        self._use(index)
        n = self._in_flight()
        log.log(
            logging.WARNING if n else logging.INFO,
            "switching to the broker at %s (%s); %d requests in flight",
            self.addresses[index],
            why,
            n,
        )

    def heard(self, index: int, msg: Message) -> bool:
        """A message from broker ``index``: whether the client acts on it (False: a
        standby's that is no answer, or a fenced broker's), switching to that broker
        when it is the active one now."""
        now = self._now()
        if msg.header.get("passive") is True:
            self.choice.refused(index, now)  # a standby: requests are parked, not failed
            return msg.route.mtype in REPLIES
        term = msg.header.get("term")
        verdict = self.choice.heard(index, term if isinstance(term, int) else None, now)
        if verdict is None:
            return False  # from a broker that was replaced: fenced
        if verdict:
            self.switch_to(index, "it is the active broker now")
        return True


def no_answer(addresses: Sequence[str], waited: float, *, passive: bool, keyed: bool) -> str:
    """Why an introduction got no map within ``waited`` seconds, as the client can tell:
    the one broker given is a pair's standby (``passive``: it answered so), or nothing
    answered (with no key of its own, the client may have reached a CURVE broker)."""
    if passive:
        hint = "it is the standby of a broker pair: give both brokers' addresses"
    elif keyed:
        hint = "is `zps-server broker` running there?"
    else:
        hint = (
            "is `zps-server broker` running there, without CURVE? A broker with CURVE does "
            "not answer a client without a key ([security])"
        )
    return f"no answer from the broker at {' or '.join(addresses)} within {waited:g}s ({hint})"
