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
