"""The systemd notify protocol (``sd_notify(3)``), without libsystemd.

A service started with ``Type=notify`` tells systemd it is up (``READY=1``), that it is
shutting down (``STOPPING=1``), what it is doing (``STATUS=...``) and that it is alive
(``WATCHDOG=1``) by sending datagrams of ``KEY=VALUE`` lines to the AF_UNIX socket named
in ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace).

Rules:

- The environment is read by the caller, not here: :meth:`Notifier.from_env` takes the
  mapping (the CLI passes ``os.environ``), so tests and embedders build a ``Notifier``
  from plain values.
- Outside systemd (no ``NOTIFY_SOCKET``) every method does nothing and returns False;
  the caller never needs to ask whether it runs under systemd.
- A failed send is logged and returns False, never raises: losing a status line must not
  take a server down, and a lost watchdog ping shows up as a watchdog restart anyway.
- ``WATCHDOG_USEC`` applies only to the process named by ``WATCHDOG_PID`` (when set), so
  a child that inherits the environment does not think it owes systemd pings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from zps.errors import ConfigError

log = logging.getLogger("zps.systemd")

#: How long a send may block (systemd reads its notify socket promptly; a stuck
#: manager must not stall the event loop for long).
SEND_TIMEOUT_S = 0.5


def _address(value: str) -> str | bytes:
    """``$NOTIFY_SOCKET`` as a ``socket.connect``/``sendto`` address."""
    if value.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of '@', no terminating NUL.
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # systemd >= 253 also speaks "vsock:CID:PORT" (for VMs); zps runs on the host.
    raise ConfigError(f"NOTIFY_SOCKET must be an absolute path or an @abstract name, got {value!r}")


def _watchdog_period(env: Mapping[str, str], pid: int) -> float | None:
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    wpid = env.get("WATCHDOG_PID")
    try:
        timeout_us = int(usec)
        if wpid and int(wpid) != pid:
            return None  # systemd set the watchdog for another process (our parent)
    except ValueError:
        raise ConfigError(
            f"WATCHDOG_USEC/WATCHDOG_PID must be integers, got {usec!r}/{wpid!r}"
        ) from None
    if timeout_us <= 0:
        raise ConfigError(f"WATCHDOG_USEC must be a positive integer, got {usec!r}")
    # sd_watchdog_enabled(3): ping at half the timeout, so one late ping is no restart.
    return timeout_us / 2e6


def watchdog_due(
    period: float | None, now: float, *, last_ping: float, last_turn: float, max_lag: float
) -> bool:
    """Whether a ping called from a server's receive path should go out now.

    Pings are rate-limited to every half ``period`` (systemd's own recommendation is
    one per period; half leaves a margin for one late wake-up), and withheld while
    another loop of the server (its timer: failure detection, leases) has not turned
    for ``max_lag`` seconds, so systemd restarts a server that reads but no longer
    keeps time, as well as one that stopped reading.
    """
    if period is None:
        return False
    return now - last_ping >= period / 2 and now - last_turn <= max_lag


def client_stall(
    now: float, *, deadline: float | None, loop_turned: float | None, margin: float
) -> str | None:
    """Why a worker's client counts as stalled at ``now``, or None while it is healthy
    (then zps-worker's watchdog pings).

    The training function's own code is never judged: it may compute, load data or
    evaluate for as long as it needs.  The client is:

    - a call in flight ends by its ``deadline`` (when it was made, plus the client's
      ``timeout``: the client fails it then); one still in flight ``margin`` seconds
      later is stalled.  Calls that wait on other workers (the step clock, the last
      tasks of a job) have no deadline and are never stalled.
    - the client's own event loop (the blocking client's thread; None when the loop is
      the training function's too) turns at least once every ``margin`` seconds.
    """
    if deadline is not None and now - deadline > margin:
        return (
            f"a client call is still in flight {now - deadline:.1f}s after its deadline "
            "(the client's timeout)"
        )
    if loop_turned is not None and now - loop_turned > margin:
        return f"the client's event loop has not turned for {now - loop_turned:.1f}s"
    return None


#: What a worker's watchdog asks before each ping: why the client is stalled, or None.
Stall = Callable[[], str | None]


def _one_line(text: str) -> str:
    # A newline would start a new KEY=VALUE assignment (e.g. a forged READY=1).
    return " ".join(text.splitlines())


@dataclass(frozen=True)
class Notifier:
    """Sends notifications to systemd; a no-op when ``address`` is None.

    ``watchdog_period`` is the recommended ping period in seconds (half of
    ``WATCHDOG_USEC``), or None when systemd expects no pings from this process.
    """

    address: str | bytes | None = None
    watchdog_period: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, pid: int | None = None) -> Notifier:
        """Build from ``NOTIFY_SOCKET``, ``WATCHDOG_USEC``, ``WATCHDOG_PID`` in ``env``.

        ``pid`` (default: this process) is compared with ``WATCHDOG_PID``. Raises
        :class:`~zps.errors.ConfigError` naming the variable if a value is malformed.
        """
        raw = env.get("NOTIFY_SOCKET")
        address = _address(raw) if raw else None
        period = _watchdog_period(env, os.getpid() if pid is None else pid)
        return cls(address=address, watchdog_period=period)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send ``state`` (newline-separated ``KEY=VALUE`` lines); True if it was sent."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(state.encode(), self.address)
        except OSError as e:
            log.warning("systemd notification %r not sent: %s", state, e)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """The service is up: systemd finishes starting the unit."""
        if status is None:
            return self.notify("READY=1")
        return self.notify(f"READY=1\nSTATUS={_one_line(status)}")

    def stopping(self, status: str | None = None) -> bool:
        """A graceful shutdown has begun (systemd shows the unit as deactivating)."""
        if status is None:
            return self.notify("STOPPING=1")
        return self.notify(f"STOPPING=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> bool:
        """A one-line status shown by ``systemctl status``."""
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """Keep-alive ping; due every :attr:`watchdog_period` seconds."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start/stop timeout fires (a long checkpoint)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1e6))}")

    async def watchdog_loop(self) -> None:
        """Ping every :attr:`watchdog_period` until cancelled; returns at once if none.

        Run it in the driver's task group: the pings then come from the event loop
        itself, so a loop blocked for longer than the timeout gets the unit restarted.
        """
        period = self.watchdog_period
        if period is None or self.address is None:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(period)

    def ping_while_healthy(self, stall: Stall, stop: threading.Event) -> None:
        """A worker's pings, from a thread of its own: every :attr:`watchdog_period`
        until ``stop`` is set, one ping unless ``stall()`` names a stall (see
        :func:`client_stall`), which is logged at error once per stall.  Returns at once
        if no pings are expected.  The thread runs beside the training function, so slow
        user code keeps the unit alive, and a frozen process (or one whose client
        stalled) is restarted by systemd ``WatchdogSec`` after its last ping."""
        period = self.watchdog_period
        if period is None or self.address is None:
            return
        stalled = False
        while True:
            why = stall()
            if why is None:
                self.watchdog()
                stalled = False
            elif not stalled:
                stalled = True
                log.error(
                    "watchdog pings withheld: %s; systemd restarts the worker once "
                    "WatchdogSec passes without one",
                    why,
                )
            if stop.wait(period):
                return
