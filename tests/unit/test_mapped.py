"""Row arrays grown in place (zps.store.mapped), and an embedding table built on them."""

from __future__ import annotations

import numpy as np
import pytest

from zps.init import Normal
from zps.optim import Adagrad
from zps.protocol.specs import EmbeddingSpec
from zps.store import mapped
from zps.store.tables import EmbeddingTable

pytestmark = pytest.mark.skipif(not mapped.IN_PLACE, reason="no mremap on this platform")

ROWS = mapped.MIN_BYTES // (8 * 4)  # 1 MiB of (n, 8) float32


def _counts() -> tuple[int, int]:
    return mapped.grown["in_place"], mapped.grown["copied"]


def test_a_mapped_array_grows_in_place_keeping_its_rows() -> None:
    holder = {"a": mapped.empty(ROWS, 8, np.float32)}
    assert mapped.mapping(holder["a"]) is not None
    holder["a"][:] = np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8)
    want = holder["a"].copy()
    before = _counts()
    for rows in (2 * ROWS, 5 * ROWS):
        mapped.grow(holder, "a", rows, ROWS)
        assert holder["a"].shape == (rows, 8) and holder["a"].dtype == np.float32
        assert holder["a"].flags.writeable and holder["a"].flags.c_contiguous
        np.testing.assert_array_equal(holder["a"][:ROWS], want)
        holder["a"][rows - 1] = 7.0  # the new rows are there to write
    assert _counts() == (before[0] + 2, before[1])


def test_an_array_viewed_elsewhere_is_copied_and_the_view_stays_valid() -> None:
    holder = {"a": mapped.empty(ROWS, 8, np.float32)}
    holder["a"][:] = 3.0
    view = holder["a"][:10]  # a reference the owner does not know about
    before = _counts()
    mapped.grow(holder, "a", 3 * ROWS, ROWS)
    assert _counts() == (before[0], before[1] + 1)
    assert (view == 3.0).all()  # still the old memory, still mapped
    assert (holder["a"][:ROWS] == 3.0).all()
    assert mapped.mapping(holder["a"]) is not None  # the copy can grow in place next time
    del view
    mapped.grow(holder, "a", 4 * ROWS, 3 * ROWS)
    assert _counts() == (before[0] + 1, before[1] + 1)


def test_small_and_foreign_arrays_are_copied() -> None:
    small = {"a": mapped.empty(4, 8, np.float32)}
    assert mapped.mapping(small["a"]) is None
    small["a"][:] = 1.0
    mapped.grow(small, "a", 8, 4)
    assert small["a"].shape == (8, 8) and (small["a"][:4] == 1.0).all()
    plain = {"a": np.full((ROWS, 8), 2.0, np.float32)}
    mapped.grow(plain, "a", 2 * ROWS, ROWS)
    assert (plain["a"][:ROWS] == 2.0).all() and mapped.mapping(plain["a"]) is not None
    part = mapped.empty(ROWS, 8, np.float32)
    assert mapped.mapping(part[: ROWS // 2]) is None  # not a whole view


def test_a_table_growing_past_millions_of_rows_keeps_every_row_and_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pushes of new ids grow the rows, Adagrad's state and the index in place once they
    are mapped (MIN_BYTES and up), through several growths; every row and its state
    equal those of a table built in one push."""
    growths: list[tuple[str, int, bool]] = []  # (array, its bytes before, in place)
    grow = mapped.grow

    def recorded(holder: dict[str, np.ndarray], key: str, rows: int, keep: int) -> None:
        nbytes, before = holder[key].nbytes, _counts()
        grow(holder, key, rows, keep)
        growths.append((key, nbytes, _counts()[0] > before[0]))

    monkeypatch.setattr(mapped, "grow", recorded)
    spec = EmbeddingSpec("t", 8, "float32", Normal(0.0, 1.0), Adagrad(lr=0.5), 5)
    grown, whole = EmbeddingTable(spec), EmbeddingTable(spec)
    rng = np.random.default_rng(3)
    n = 1 << 20
    ids = rng.permutation(np.arange(n, dtype=np.int64) * 7)
    grads = rng.standard_normal((n, 8)).astype(np.float32)
    for lo in range(0, n, 1 << 16):
        grown.push(ids[lo : lo + (1 << 16)], grads[lo : lo + (1 << 16)])
    big = [(k, in_place) for k, nbytes, in_place in growths if nbytes >= mapped.MIN_BYTES]
    assert {k for k, _ in big} == {"_rows", "accumulator", "ids", "slots"}, big
    assert all(in_place for _, in_place in big), big
    assert len(big) >= 12, big
    whole.push(ids, grads)
    a, b = grown.export(), whole.export()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def _no_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(rows: int, width: int, dtype: object) -> np.ndarray:
        raise MemoryError(f"no room for {rows} rows")

    monkeypatch.setattr(mapped, "empty", refused)


def test_an_array_that_cannot_be_grown_is_left_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Viewed elsewhere (so copied) and no memory for the copy: the holder keeps the
    array, its rows intact, and a later growth (memory back, view gone) works."""
    holder = {"a": mapped.empty(ROWS, 8, np.float32)}
    holder["a"][:] = 5.0
    view = holder["a"][:1]
    with monkeypatch.context() as m:
        _no_memory(m)
        with pytest.raises(MemoryError):
            mapped.grow(holder, "a", 2 * ROWS, ROWS)
    assert holder["a"].shape == (ROWS, 8) and (holder["a"] == 5.0).all()
    del view
    mapped.grow(holder, "a", 2 * ROWS, ROWS)
    assert holder["a"].shape == (2 * ROWS, 8) and (holder["a"][:ROWS] == 5.0).all()


def test_a_push_whose_growth_runs_out_of_memory_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rows, the state and the index: a MemoryError part way through a growth
    leaves the table as it was (no id without its row), and the push can be retried."""
    spec = EmbeddingSpec("t", 8, "float32", Normal(0.0, 1.0), Adagrad(lr=0.5), 5)
    table = EmbeddingTable(spec)
    first = np.arange(ROWS, dtype=np.int64)
    table.push(first, np.ones((ROWS, 8), np.float32))
    want = table.export()
    more = np.arange(ROWS, 3 * ROWS, dtype=np.int64)
    grads = np.ones((more.size, 8), np.float32)
    state_view = table._state["accumulator"][:1]  # pins the state: it must be copied
    with monkeypatch.context() as m:
        _no_memory(m)
        with pytest.raises(MemoryError):
            table.push(more, grads)
    del state_view
    got = table.export()
    assert len(table) == ROWS
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    table.push(more, grads)  # memory back: the same push, applied once
    assert len(table) == 3 * ROWS
    caps = {a.shape[0] for a in (table._rows, *table._state.values())}
    assert len(caps) == 1, caps  # every array the same capacity again


def test_an_index_whose_rehash_runs_out_of_memory_still_finds_every_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zps.store.index import IdIndex

    index = IdIndex()
    ids = np.arange(1 << 16, dtype=np.int64) * 3
    pos, n = index.get_or_insert(ids)
    assert n == ids.size
    pinned = index._slots[:1]  # copied on the next rehash, which has no memory
    with monkeypatch.context() as m:
        _no_memory(m)
        with pytest.raises(MemoryError):
            index.get_or_insert(np.arange(1 << 17, 1 << 18, dtype=np.int64) * 3 + 1)
    del pinned
    assert len(index) == ids.size
    np.testing.assert_array_equal(index.lookup(ids), pos)
    more = np.arange(1 << 17, dtype=np.int64) * 3 + 1
    _, n = index.get_or_insert(more)
    assert n == more.size and len(index) == ids.size + more.size
