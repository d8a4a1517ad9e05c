import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from zps.core.batching import groups_by_bytes, merge_row_ops, plan_batches, row_runs, split_push
from zps.init import Normal
from zps.optim import Adagrad
from zps.protocol.specs import EmbeddingSpec
from zps.store.partition import PartitionStore


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


def test_merging_stops_at_the_byte_budget() -> None:
    ops = [_pull("a", [i]) for i in range(10)]
    merged = merge_row_ops(ops, sizes=[100] * 10, max_bytes=350)
    assert [len(m.parts) for m in merged] == [3, 3, 3, 1]
    assert [i for m in merged for i, _, _ in m.parts] == list(range(10))
    # An operation larger than the budget still travels, alone.
    merged = merge_row_ops(ops[:3], sizes=[10, 1000, 10], max_bytes=100)
    assert [m.parts for m in merged] == [((0, 0, 1),), ((1, 0, 1),), ((2, 0, 1),)]


@given(
    st.lists(st.integers(0, 500), min_size=1, max_size=40),
    st.integers(1, 1200),
    st.integers(1, 8),
)
def test_merged_groups_stay_within_budget(sizes: list[int], budget: int, max_members: int) -> None:
    ops = [_pull("a", [i]) for i in range(len(sizes))]
    merged = merge_row_ops(ops, max_members, sizes=sizes, max_bytes=budget)
    assert sorted(i for m in merged for i, _, _ in m.parts) == list(range(len(sizes)))
    for m in merged:
        members = [i for i, _, _ in m.parts]
        assert len(members) <= max_members
        assert len(members) == 1 or sum(sizes[i] for i in members) <= budget


@given(st.integers(0, 5000), st.integers(0, 700), st.integers(1, 100_000))
def test_row_runs_cover_rows_within_budget(n_rows: int, row_bytes: int, budget: int) -> None:
    runs = row_runs(n_rows, row_bytes, budget)
    assert [i for a, b in runs for i in range(a, b)] == list(range(n_rows))
    for a, b in runs:
        assert b > a
        assert b - a == 1 or (b - a) * row_bytes <= budget
    if runs:  # as few runs as the budget allows, and even
        per = max(1, budget // max(row_bytes, 1))
        assert len(runs) == -(-n_rows // per)
        sizes = {b - a for a, b in runs}
        assert max(sizes) - min(sizes) <= 1


def test_groups_by_bytes() -> None:
    assert groups_by_bytes([4, 4, 4, 9, 1], 8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert groups_by_bytes([], 8) == []


def test_a_push_that_fits_is_returned_as_given() -> None:
    ids = np.array([3, 1, 3], dtype=np.int64)
    g = np.ones((3, 4), dtype=np.float32)
    [(i, x)] = split_push(ids, g, budget=3 * (8 + 16))
    assert i is ids and x is g


def _apply(pieces: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    store = PartitionStore()
    store.create(EmbeddingSpec("e", 4, "float32", Normal(0.0, 1.0), Adagrad(lr=0.1), 7))
    for ids, g in pieces:
        store.embedding("e").push(ids, g)
    return np.asarray(store.embedding("e").pull(np.arange(50, dtype=np.int64)))


@given(st.lists(st.integers(0, 49), min_size=1, max_size=300), st.integers(24, 2000))
def test_split_push_equals_the_whole_push(id_list: list[int], budget: int) -> None:
    ids = np.array(id_list, dtype=np.int64)
    rng = np.random.default_rng(len(id_list))
    g = rng.standard_normal((ids.size, 4)).astype(np.float32)
    pieces = split_push(ids, g, budget)
    row_bytes = 8 + 16
    for i, x in pieces:
        assert i.size * row_bytes <= budget or i.size == 1
        assert x.shape == (i.size, 4)
    every = np.concatenate([i for i, _ in pieces])
    if len(pieces) > 1:
        # Each id travels once, so no id gets two optimizer updates.
        assert every.tolist() == sorted(set(id_list))
    # The shard ends with exactly the same rows (bit for bit) as for one message.
    assert np.array_equal(_apply(pieces), _apply([(ids, g)]))
