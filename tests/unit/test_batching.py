from hypothesis import given
from hypothesis import strategies as st

from zps.batching import plan_batches


def test_small_ops_share_one_message() -> None:
    assert plan_batches([10] * 100, max_ops=512, max_bytes=1 << 20) == [(0, 100)]


def test_limits_split_and_big_op_travels_alone() -> None:
    assert plan_batches([10] * 5, max_ops=2, max_bytes=1000) == [(0, 2), (2, 4), (4, 5)]
    assert plan_batches([10, 5000, 10], max_ops=10, max_bytes=100) == [(0, 1), (1, 2), (2, 3)]
    assert plan_batches([], max_ops=1, max_bytes=1) == []


@given(st.lists(st.integers(0, 1000), max_size=200), st.integers(1, 20), st.integers(1, 3000))
def test_runs_cover_everything_in_order_within_limits(
    sizes: list[int], max_ops: int, max_bytes: int
) -> None:
    runs = plan_batches(sizes, max_ops, max_bytes)
    assert [i for a, b in runs for i in range(a, b)] == list(range(len(sizes)))
    for a, b in runs:
        assert 1 <= b - a <= max_ops
        assert b - a == 1 or sum(sizes[a:b]) <= max_bytes
