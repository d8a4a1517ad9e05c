"""A large id index is rebuilt at twice the capacity by a thread: the table in use
serves lookups and takes new ids meanwhile (up to a load of 3/4), the thread places
those too, and the next insert after the build swaps the new table in.  A build that
fails leaves the rebuild to the caller, in place, as before."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from zps.store import index
from zps.store.index import IdIndex

pytestmark = pytest.mark.skipif(not index.KERNEL, reason="the C kernel is off or not built")

CAP = 1 << 12  # the table's capacity when its first build starts (at 2,048 ids)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Builds of tables of CAP slots and more, each held until the gate opens."""
    monkeypatch.setattr(index, "BACKGROUND_SLOTS", CAP)
    opened = threading.Event()
    place = index._fill_and_place

    def held(slots: np.ndarray, ids: np.ndarray) -> None:
        assert opened.wait(30), "the test never opened the gate"
        place(slots, ids)

    monkeypatch.setattr(index, "_fill_and_place", held)
    yield opened
    opened.set()  # a build still held ends


def _ids(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(np.arange(1, n + 1, dtype=np.int64) * 7919)


def _past_half(idx: IdIndex, ids: np.ndarray) -> None:
    """CAP // 2 + 1 ids in ``idx``: the last insert started a build."""
    idx.get_or_insert(ids[:2000])
    assert idx.capacity == CAP and not idx.building
    idx.get_or_insert(ids[2000 : CAP // 2 + 1])


def _check(idx: IdIndex, ids: np.ndarray) -> None:
    np.testing.assert_array_equal(idx.lookup(ids), np.arange(ids.size))
    absent = ids[: min(ids.size, 500)] + 1  # multiples of 7919 plus 1: never inserted
    assert (idx.lookup(absent) == -1).all()
    np.testing.assert_array_equal(idx.ids(), ids)


def test_the_table_in_use_serves_while_its_successor_is_built(gate: threading.Event) -> None:
    ids = _ids(CAP)
    idx = IdIndex()
    idx.get_or_insert(ids[:2000])
    assert idx.capacity == CAP and not idx.building
    idx.get_or_insert(ids[2000:2100])  # past half full: a thread builds the next table
    assert idx.building and idx.capacity == CAP
    # Up to 3/4 of the old table, ids go into it: every one is found, in order.
    for a in range(2100, 3 * CAP // 4, 97):
        b = min(a + 97, 3 * CAP // 4)
        pos, added = idx.get_or_insert(ids[a - 50 : b])  # some present, some new
        assert added == b - a
        np.testing.assert_array_equal(pos, np.arange(a - 50, b))
    assert idx.building and idx.capacity == CAP
    _check(idx, ids[: 3 * CAP // 4])
    gate.set()
    build = idx._build
    assert build is not None and build.done.wait(30)
    idx.get_or_insert(ids[3 * CAP // 4 : 3 * CAP // 4 + 1])  # the next insert swaps it in
    assert not idx.building and idx.capacity == 2 * CAP
    _check(idx, ids[: 3 * CAP // 4 + 1])


def test_an_insert_past_three_quarters_takes_the_built_table(gate: threading.Event) -> None:
    ids = _ids(CAP)
    idx = IdIndex()
    _past_half(idx, ids)
    assert idx.building
    gate.set()  # the insert below waits for the build if it is not done yet
    pos, added = idx.get_or_insert(ids[CAP // 2 + 1 :])  # 1/2 to 1: past 3/4 at once
    assert added == CAP - CAP // 2 - 1
    np.testing.assert_array_equal(pos, np.arange(CAP // 2 + 1, CAP))
    assert not idx.building and idx.capacity == 2 * CAP  # the built one, half full
    _check(idx, ids)


def test_the_thread_places_the_ids_that_came_during_the_build(
    gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index, "CATCH_UP_IDS", 1)
    ids = _ids(CAP)
    idx = IdIndex()
    _past_half(idx, ids)
    build = idx._build
    assert build is not None
    idx.get_or_insert(ids[CAP // 2 + 1 : CAP // 2 + 700])  # while the build is held
    gate.set()
    assert build.done.wait(30)
    assert build.placed == CAP // 2 + 700 and build.error is None  # none left for the swap
    idx.get_or_insert(ids[CAP // 2 + 700 : CAP // 2 + 701])
    assert not idx.building
    _check(idx, ids[: CAP // 2 + 701])


def test_a_build_that_fails_leaves_the_rebuild_to_the_next_insert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(index, "BACKGROUND_SLOTS", CAP)

    def no_memory(slots: np.ndarray, ids: np.ndarray) -> None:
        raise MemoryError

    monkeypatch.setattr(index, "_fill_and_place", no_memory)
    ids = _ids(CAP)
    idx = IdIndex()
    _past_half(idx, ids)
    build = idx._build
    assert build is not None and build.done.wait(30)
    assert isinstance(build.error, MemoryError)
    _check(idx, ids[: CAP // 2 + 1])  # the old table serves on
    idx.get_or_insert(ids[CAP // 2 + 1 : CAP // 2 + 2])
    assert not idx.building and idx.capacity == 2 * CAP  # rebuilt in place
    _check(idx, ids[: CAP // 2 + 2])


def test_small_tables_are_rebuilt_at_once() -> None:
    idx = IdIndex()
    ids = _ids(10_000)
    for a in range(0, ids.size, 1000):
        idx.get_or_insert(ids[a : a + 1000])
        assert not idx.building  # far below BACKGROUND_SLOTS
        assert 2 * len(idx) <= idx.capacity
    _check(idx, ids)


def test_a_table_pushed_and_pulled_through_its_index_builds_matches_one_built_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table's kernels probe the table in use, at loads up to 3/4 while a build
    runs: every row pulled between pushes, and the final rows and state, equal those
    of a table that got the same pushes with its index rebuilt at once."""
    from zps.init import Normal
    from zps.optim import Adagrad
    from zps.protocol.specs import EmbeddingSpec
    from zps.store.tables import EmbeddingTable

    spec = EmbeddingSpec("t", 8, "float32", Normal(0.0, 1.0), Adagrad(lr=0.5), 5)
    rng = np.random.default_rng(4)
    ids = _ids(40_000, seed=4)
    grads = rng.standard_normal((ids.size, 8)).astype(np.float32)
    steps = [(a, min(a + 700, ids.size)) for a in range(0, ids.size, 700)]

    def run(background: int) -> tuple[EmbeddingTable, list[np.ndarray], int]:
        monkeypatch.setattr(index, "BACKGROUND_SLOTS", background)
        table, pulled, builds = EmbeddingTable(spec), [], 0
        for a, b in steps:
            old = max(0, a - 300)  # rows seen before, and new ones
            table.push(ids[old:b], grads[old:b])
            builds += table._index.building
            pulled.append(table.pull(ids[max(0, a - 5000) : b]))
        return table, pulled, builds

    at_once, want, none = run(1 << 62)
    built, got, builds = run(CAP)
    assert none == 0 and builds > 0  # pushes made while a build ran
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    a, b = built.export(), at_once.export()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_a_build_done_after_the_last_insert_is_swapped_in_by_a_read(
    gate: threading.Event,
) -> None:
    from zps.init import Zeros
    from zps.optim import SGD
    from zps.protocol.specs import EmbeddingSpec
    from zps.store.tables import EmbeddingTable

    table = EmbeddingTable(EmbeddingSpec("t", 4, "float32", Zeros(), SGD(lr=1.0), 0))
    ids = _ids(CAP // 2 + 1)
    table.push(ids[:2000], np.ones((2000, 4), np.float32))
    table.push(ids[2000:], np.ones((ids.size - 2000, 4), np.float32))
    build = table._index._build
    assert build is not None
    held = table.nbytes
    gate.set()
    assert build.done.wait(30)
    np.testing.assert_array_equal(table.pull(ids), -np.ones((ids.size, 4), np.float32))
    assert not table._index.building and table._index.capacity == 2 * CAP
    assert table.nbytes == held - CAP * 16  # the old slot table let go
