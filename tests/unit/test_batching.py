import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from zps.core.batching import merge_row_ops, plan_batches


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


def _push(t: str, ids: list[int], step: int | None = None) -> tuple[dict, dict]:
    body = {"op": "push_rows", "t": t}
    if step is not None:
        body["step"] = step
    a = np.array(ids, dtype=np.int64)
    return body, {"ids": a, "g": np.ones((a.size, 2)) * a[:, None]}


def _pull(t: str, ids: list[int]) -> tuple[dict, dict]:
    return {"op": "pull_rows", "t": t}, {"ids": np.array(ids, dtype=np.int64)}


def test_row_ops_on_one_table_merge_and_keep_their_rows() -> None:
    ops = [
        _push("a", [1]),
        _push("a", [2, 3]),
        _pull("a", [5, 5]),
        _pull("a", [6]),
        _push("b", [1]),
    ]
    merged = merge_row_ops(ops)
    assert [m.body["op"] for m in merged] == ["push_rows", "pull_rows", "push_rows"]
    pushes = merged[0]
    assert pushes.parts == ((0, 0, 1), (1, 1, 3))
    assert pushes.arrays["ids"].tolist() == [1, 2, 3]
    assert pushes.arrays["g"][:, 0].tolist() == [1, 2, 3]  # rows travel with their ids
    assert merged[1].parts == ((2, 0, 2), (3, 2, 3))
    assert merged[2].parts == ((4, 0, 1),)


def test_overlapping_pushes_do_not_merge() -> None:
    # Two Adagrad updates of row 1 are not one update of their sum.
    merged = merge_row_ops([_push("a", [1, 2]), _push("a", [3]), _push("a", [1])])
    assert [m.parts for m in merged] == [((0, 0, 2), (1, 2, 3)), ((2, 0, 1),)]


def test_steps_and_other_ops_separate_groups_and_keep_order() -> None:
    create = ({"op": "create", "spec": {}}, {})
    merged = merge_row_ops(
        [
            _push("a", [1], step=0),
            _push("a", [2], step=1),
            _push("a", [3], step=0),
            ({"op": "x", "t": "a"}, {}),
            _push("a", [4], step=0),
            create,
        ]
    )
    assert [m.parts for m in merged] == [
        ((0, 0, 1), (2, 1, 2)),
        ((1, 0, 1),),
        ((3, 0, 0),),
        ((4, 0, 1),),
        ((5, 0, 0),),
    ]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push_rows", "pull_rows"]),
            st.sampled_from("ab"),
            st.lists(st.integers(0, 20), min_size=1, max_size=4),
        ),
        max_size=30,
    )
)
def test_merging_covers_every_op_once_with_its_ids(spec: list) -> None:
    ops = [(_push if op == "push_rows" else _pull)(t, ids) for op, t, ids in spec]
    merged = merge_row_ops(ops)
    seen = sorted(i for m in merged for i, _, _ in m.parts)
    assert seen == list(range(len(ops)))
    for m in merged:
        for i, a, b in m.parts:
            assert m.arrays["ids"][a:b].tolist() == ops[i][1]["ids"].tolist()
        if m.body["op"] == "push_rows":
            parts = [set(ops[i][1]["ids"].tolist()) for i, _, _ in m.parts]
            assert sum(len(p) for p in parts) == len(set().union(*parts))  # pairwise disjoint
