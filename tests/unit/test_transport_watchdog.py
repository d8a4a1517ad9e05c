"""When a server pings the systemd watchdog from its receive path."""

from __future__ import annotations

from zps.ops.systemd import watchdog_due


def test_no_watchdog_no_ping() -> None:
    assert not watchdog_due(None, 100.0, last_ping=0.0, last_turn=100.0, max_lag=1.0)


def test_pings_are_rate_limited_to_half_the_period() -> None:
    assert watchdog_due(2.0, 10.0, last_ping=9.0, last_turn=10.0, max_lag=1.0)
    assert not watchdog_due(2.0, 10.0, last_ping=9.5, last_turn=10.0, max_lag=1.0)


def test_a_stalled_timer_loop_withholds_the_ping() -> None:
    # The receive path runs, but failure detection has not turned for 3 s: no ping,
    # so systemd restarts the server.
    assert not watchdog_due(2.0, 10.0, last_ping=0.0, last_turn=7.0, max_lag=1.0)
    assert watchdog_due(2.0, 10.0, last_ping=0.0, last_turn=9.5, max_lag=1.0)
