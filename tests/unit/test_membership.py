from zps.core.membership import FailureDetector


def ticks(fd: FailureDetector, start: float, stop: float, step: float = 0.1) -> list[str]:
    dead: list[str] = []
    t = start
    while t <= stop + 1e-9:
        dead += fd.tick(t)
        t += step
    return dead


def test_peer_dies_only_after_timeout_and_traffic_keeps_it_alive() -> None:
    fd = FailureDetector(interval=0.2, liveness=5)
    fd.seen("a", 0.0)
    fd.seen("b", 0.0)
    assert ticks(fd, 0.0, 0.9) == []
    fd.seen("a", 0.9)
    assert fd.tick(1.05) == ["b"]
    assert "b" not in fd and "a" in fd
    assert ticks(fd, 1.1, 1.85) == []
    assert fd.tick(1.95) == ["a"]


def test_own_stall_does_not_kill_peers() -> None:
    fd = FailureDetector(interval=0.2, liveness=5)
    fd.seen("a", 0.0)
    assert fd.tick(0.1) == []
    # the process was paused for 30 s: peers' heartbeats are queued, unread
    assert fd.tick(30.0) == []
    assert "a" in fd
    # but a peer that stays silent after the stall still dies on time
    assert ticks(fd, 30.1, 30.9) == []
    assert fd.tick(31.05) == ["a"]


def test_forget_and_invalid_settings() -> None:
    fd = FailureDetector(interval=1.0, liveness=1)
    fd.seen("x", 0.0)
    fd.forget("x")
    assert fd.tick(10.0) == []
    for bad in ((0.0, 1), (1.0, 0)):
        try:
            FailureDetector(*bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_a_suspect_dies_after_the_grace_unless_heard_from() -> None:
    fd = FailureDetector(interval=0.2, liveness=5)
    fd.seen("a", 0.0)
    fd.seen("b", 0.0)
    fd.tick(0.1)
    fd.suspect("a", 0.1, grace=0.4)
    fd.suspect("b", 0.1, grace=0.4)
    fd.seen("b", 0.3)  # b reconnected and spoke
    assert ticks(fd, 0.2, 0.45) == []
    assert fd.tick(0.55) == ["a"]
    assert "b" in fd
    fd.suspect("nobody", 0.6, grace=0.4)  # unknown peers are ignored
    assert "nobody" not in fd


def test_a_stall_before_the_first_tick_does_not_kill_peers() -> None:
    """A broker paused in its first moments (peers registered, no tick yet): its first
    tick, 30 s later, sees its own stall, as any later tick would."""
    fd = FailureDetector(interval=0.1, liveness=10, start=0.0)
    fd.seen("shard", 0.01)
    fd.seen("client", 0.03)
    assert fd.tick(30.0) == []
    assert ticks(fd, 30.05, 30.95, step=0.05) == []
    assert sorted(fd.tick(31.05)) == ["client", "shard"]  # silent after it: dead on time
    # Without a start, the first peer heard stands for it.
    fd = FailureDetector(interval=0.1, liveness=10)
    fd.seen("shard", 5.0)
    assert fd.tick(35.0) == []
    assert "shard" in fd
    # A detector that starts watching and ticks on time still blames a silent peer.
    fd = FailureDetector(interval=0.1, liveness=10, start=0.0)
    fd.seen("shard", 0.0)
    assert ticks(fd, 0.05, 0.95, step=0.05) == []
    assert fd.tick(1.05) == ["shard"]


def _linked(now: float = 0.0) -> FailureDetector:
    """A detector watching shard "s" whose liveness link has carried a message."""
    fd = FailureDetector(interval=0.2, liveness=5, start=now)
    fd.seen("s", now)
    fd.linked("s")
    return fd


def test_one_connection_closed_gives_the_shard_two_intervals() -> None:
    fd = _linked()
    assert fd.tick(0.1) == []
    # the data connection's route dropped: probe the liveness link
    assert fd.route_dropped("s", False, 0.15) is True
    assert fd.probes(0.2) == [("s", True)]
    assert fd.tick(0.2) == [] and fd.tick(0.5) == []
    assert fd.tick(0.6) == ["s"]
    assert not fd.closed("s")  # found by its silence
    assert fd.probes(0.7) == []


def test_both_connections_closed_is_dead_at_the_next_tick() -> None:
    fd = _linked()
    assert fd.tick(0.1) == []
    assert fd.route_dropped("s", False, 0.15) is True
    # the probe of the liveness link finds its route gone too
    assert fd.route_dropped("s", True, 0.15) is False
    assert fd.tick(0.2) == ["s"]
    assert fd.closed("s") and not fd.closed("s")
    # the other order, the second close seen on a later tick's probe
    fd = _linked()
    fd.tick(0.1)
    fd.route_dropped("s", True, 0.12)
    assert fd.probes(0.2) == [("s", False)]
    assert fd.tick(0.2) == []
    assert fd.route_dropped("s", False, 0.3) is False
    assert fd.tick(0.4) == ["s"]


def test_drops_further_apart_than_the_grace_are_two_reconnections() -> None:
    fd = _linked()
    fd.tick(0.1)
    fd.route_dropped("s", False, 0.15)
    fd.seen("s", 0.3)  # it made its data connection again and spoke
    assert fd.probes(0.6) == []  # the drop is older than two intervals
    fd.route_dropped("s", True, 0.6)
    assert fd.tick(0.7) == []  # two intervals again, not dead at once
    assert "s" in fd


def test_a_shard_without_a_liveness_link_gets_the_grace() -> None:
    fd = FailureDetector(interval=0.2, liveness=5, start=0.0)
    fd.seen("s", 0.0)
    assert fd.route_dropped("s", False, 0.15) is False  # nothing else to probe
    assert fd.route_dropped("s", True, 0.15) is False
    assert fd.tick(0.2) == [] and fd.tick(0.5) == []


def test_connections_closed_after_an_own_stall_get_the_grace() -> None:
    """A broker paused for seconds: its shards' connections were made again meanwhile
    (that silence is what makes them reconnect), and the old routes drop as it resumes;
    within a timeout of its stall a shard with both routes gone gets the two intervals."""
    fd = _linked()
    fd.tick(0.1)
    assert fd.tick(10.0) == []  # resumed after a 10 s pause
    assert fd.route_dropped("s", False, 10.05) is False
    fd.route_dropped("s", True, 10.05)
    assert fd.tick(10.1) == [] and fd.tick(10.3) == []
    fd.seen("s", 10.3)  # it speaks on its new connections
    assert ticks(fd, 10.4, 11.2) == []
    # before the first tick after the pause, the stall rule itself keeps it
    fd = _linked()
    fd.tick(0.1)
    fd.route_dropped("s", False, 10.0)
    fd.route_dropped("s", True, 10.0)
    assert fd.tick(10.01) == []
    assert "s" in fd
