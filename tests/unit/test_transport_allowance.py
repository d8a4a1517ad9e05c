"""The byte accounting behind the broker's per-peer outbound queues."""

from __future__ import annotations

import pytest

from zps.errors import ConfigError
from zps.ops.config import BrokerConfig
from zps.transport import Allowance, message_bytes


def test_a_peer_is_admitted_up_to_its_own_limit() -> None:
    a = Allowance(total_limit=1000)
    assert a.admit(b"c-1", 60, limit=100, now=0.0)
    assert a.admit(b"c-1", 40, limit=100, now=0.0)
    assert not a.admit(b"c-1", 1, limit=100, now=0.0)
    assert a.held(b"c-1") == 100
    assert a.admit(b"c-2", 100, limit=100, now=0.0)  # another peer has its own allowance
    assert a.total == 200
    assert a.peak == 200 and a.peak_peer == 100


def test_the_total_bounds_every_peer_together() -> None:
    a = Allowance(total_limit=150)
    assert a.admit(b"c-1", 100, limit=100, now=0.0)
    assert not a.admit(b"c-2", 60, limit=100, now=0.0)
    assert a.admit(b"c-2", 50, limit=100, now=0.0)
    assert a.total == 150
    assert a.peers == 2


def test_a_refused_message_counts_nothing() -> None:
    a = Allowance(total_limit=100)
    assert not a.admit(b"c-1", 101, limit=1000, now=0.0)
    assert a.total == 0 and a.peers == 0 and a.held(b"c-1") == 0
    assert a.stalled(now=100.0, timeout=1.0) == []


def test_release_frees_bytes_and_restarts_the_stall_clock() -> None:
    a = Allowance(total_limit=1000)
    a.admit(b"c-1", 100, limit=1000, now=0.0)
    a.admit(b"c-1", 100, limit=1000, now=1.0)
    assert a.stalled(now=5.0, timeout=5.0) == [b"c-1"]  # since its queue started, at 0
    a.release(b"c-1", 100, now=5.0)
    assert a.held(b"c-1") == 100 and a.total == 100
    assert a.stalled(now=9.0, timeout=5.0) == []
    assert a.stalled(now=10.0, timeout=5.0) == [b"c-1"]
    a.release(b"c-1", 100, now=10.0)
    assert a.peers == 0 and a.total == 0
    assert a.stalled(now=100.0, timeout=5.0) == []


def test_release_never_goes_below_zero() -> None:
    a = Allowance(total_limit=1000)
    a.admit(b"c-1", 10, limit=1000, now=0.0)
    a.release(b"c-1", 50, now=0.0)
    a.release(b"c-unknown", 50, now=0.0)
    assert a.total == 0 and a.peers == 0


def test_forget_frees_all_a_peer_holds() -> None:
    a = Allowance(total_limit=1000)
    a.admit(b"c-1", 70, limit=1000, now=0.0)
    a.admit(b"c-2", 30, limit=1000, now=0.0)
    assert a.forget(b"c-1") == 70
    assert a.forget(b"c-1") == 0
    assert a.total == 30 and a.peers == 1
    assert a.peak == 100  # the peak is a high-water mark


def test_a_negative_total_is_refused() -> None:
    with pytest.raises(ValueError, match="total_limit"):
        Allowance(total_limit=-1)


def test_message_bytes_counts_every_frame() -> None:
    assert message_bytes([b"abc", bytearray(2), memoryview(b"12345678").cast("I")]) == 13
    assert message_bytes([]) == 0


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("client_queue_bytes", -1, "broker.client_queue_bytes must be an integer >= 0"),
        ("shard_queue_bytes", 1.5, "broker.shard_queue_bytes must be an integer >= 0"),
        ("queue_bytes", True, "broker.queue_bytes must be an integer >= 0"),
        ("stall_timeout", 0, "broker.stall_timeout must be a positive number"),
    ],
)
def test_the_broker_flow_settings_are_checked(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BrokerConfig(**{key: value})  # type: ignore[arg-type]
