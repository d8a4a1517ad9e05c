"""IdIndex against a plain dict reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.core.hashing import mix64
from zps.errors import BadRequestError
from zps.store.index import EMPTY, IdIndex


class Reference:
    def __init__(self) -> None:
        self.pos: dict[int, int] = {}

    def get_or_insert(self, ids: list[int]) -> tuple[list[int], int]:
        before = len(self.pos)
        for i in ids:
            self.pos.setdefault(i, len(self.pos))
        return [self.pos[i] for i in ids], len(self.pos) - before

    def lookup(self, ids: list[int]) -> list[int]:
        return [self.pos.get(i, -1) for i in ids]


def check_consistent(index: IdIndex, ref: Reference) -> None:
    assert len(index) == len(ref.pos)
    assert index.ids().tolist() == list(ref.pos)
    assert index.capacity >= 2 * len(index)  # load factor <= 1/2


# Small id ranges force repeated ids; wide ones exercise the whole int64 range.
ids_lists = st.lists(
    st.one_of(
        st.integers(-40, 40),
        st.integers(EMPTY + 1, 2**63 - 1),
    ),
    max_size=60,
)
ops = st.lists(
    st.tuples(st.sampled_from(["get_or_insert", "lookup", "insert"]), ids_lists), max_size=25
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_operations_match_dict(operations: list[tuple[str, list[int]]]) -> None:
    index, ref = IdIndex(), Reference()
    for op, ids in operations:
        arr = np.array(ids, dtype=np.int64)
        if op == "lookup":
            assert index.lookup(arr).tolist() == ref.lookup(ids)
        elif op == "get_or_insert":
            pos, n_new = index.get_or_insert(arr)
            want_pos, want_new = ref.get_or_insert(ids)
            assert (pos.tolist(), n_new) == (want_pos, want_new)
        else:
            fresh = list(dict.fromkeys(i for i in ids if i not in ref.pos))
            got = index.insert(np.array(fresh, dtype=np.int64))
            want, _ = ref.get_or_insert(fresh)
            assert got.tolist() == want
        check_consistent(index, ref)


def colliding_ids(n: int, capacity: int, home: int = 3) -> np.ndarray:
    """``n`` ids whose home slot in a table of ``capacity`` is ``home``."""
    cand = np.arange(200_000, dtype=np.int64)
    hits: np.ndarray = cand[(mix64(cand) & np.uint64(capacity - 1)) == np.uint64(home)]
    assert hits.size >= n
    return hits[:n]


def test_many_ids_on_one_home_slot_are_all_found() -> None:
    ids = colliding_ids(7, 16)  # 7 of 16 slots: stays below the growth threshold
    index = IdIndex(16)
    index.insert(ids)
    assert index.capacity == 16
    assert index.lookup(ids).tolist() == list(range(7))
    assert index.lookup(colliding_ids(9, 16)[7:]).tolist() == [-1, -1]


def test_probe_wraps_around_the_end_of_the_table() -> None:
    ids = colliding_ids(6, 16, home=14)
    index = IdIndex(16)
    index.insert(ids)
    assert index.lookup(ids).tolist() == list(range(6))


def test_colliding_claims_in_one_batch_and_across_batches() -> None:
    ids = colliding_ids(7, 32, home=31)
    index = IdIndex(32)
    pos, n_new = index.get_or_insert(np.concatenate([ids[:4], ids[:2]]))
    assert (pos.tolist(), n_new) == ([0, 1, 2, 3, 0, 1], 4)
    pos, n_new = index.get_or_insert(ids[::-1])
    # New ids take positions in first-occurrence order.
    assert (pos.tolist(), n_new) == ([4, 5, 6, 3, 2, 1, 0], 3)


def test_growth_keeps_every_position() -> None:
    rng = np.random.default_rng(1)
    ids = np.unique(rng.integers(-(2**62), 2**62, 50_000))
    rng.shuffle(ids)
    index = IdIndex()
    for chunk in np.array_split(ids, 37):
        index.insert(chunk)
    assert np.array_equal(index.lookup(ids), np.arange(ids.size))
    assert np.array_equal(index.ids(), ids)
    assert np.array_equal(index.ids(ids.size - 5), ids[-5:])
    assert index.capacity >= 2 * ids.size
    assert index.nbytes >= 16 * index.capacity
    absent = np.setdiff1d(rng.integers(-(2**62), 2**62, 1000), ids)
    assert (index.lookup(absent) == -1).all()


def test_sentinel_is_rejected_and_never_found() -> None:
    index = IdIndex()
    index.insert(np.array([1, 2], dtype=np.int64))
    with pytest.raises(BadRequestError, match=str(EMPTY)):
        index.insert(np.array([EMPTY], dtype=np.int64))
    with pytest.raises(BadRequestError, match=str(EMPTY)):
        index.get_or_insert(np.array([5, EMPTY], dtype=np.int64))
    assert index.lookup(np.array([EMPTY, 2], dtype=np.int64)).tolist() == [-1, 1]
    assert len(index) == 2


def test_ids_must_be_one_dimensional_integers() -> None:
    index = IdIndex()
    with pytest.raises(BadRequestError, match="1-D"):
        index.lookup(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(BadRequestError, match="int64"):
        index.get_or_insert(np.array([1.5]))
    with pytest.raises(BadRequestError, match="int64"):
        index.lookup(np.array([2**64 - 1], dtype=np.uint64))
    assert index.get_or_insert(np.array([3], dtype=np.int32))[0].tolist() == [0]
    assert index.lookup(np.array([], dtype=np.float64)).tolist() == []


def test_empty_batches() -> None:
    index = IdIndex()
    empty = np.array([], dtype=np.int64)
    assert index.insert(empty).tolist() == []
    pos, n_new = index.get_or_insert(empty)
    assert (pos.tolist(), n_new) == ([], 0)
    assert len(index) == 0
