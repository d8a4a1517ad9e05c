from zps.membership import FailureDetector


def test_peer_dies_only_after_timeout_and_traffic_keeps_it_alive() -> None:
    fd = FailureDetector(interval=0.2, liveness=5)
    fd.seen("a", 0.0)
    fd.seen("b", 0.0)
    assert fd.tick(0.9) == []
    fd.seen("a", 0.9)
    assert fd.tick(1.05) == ["b"]
    assert "b" not in fd and "a" in fd
    assert fd.tick(1.85) == []
    assert fd.tick(1.95) == ["a"]


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
