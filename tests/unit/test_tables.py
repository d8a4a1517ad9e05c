"""Embedding tables, dense chunks and the partition store."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.errors import BadRequestError, ShapeMismatchError, TableConflictError, UnknownTableError
from zps.init import Normal, Uniform, Zeros, generate
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum, Optimizer
from zps.store import DenseSpec, DenseTensor, EmbeddingSpec, EmbeddingTable, PartitionStore

OPTIMIZERS: list[Optimizer] = [SGD(lr=0.1), Momentum(), Adagrad(), Adam(), FTRL()]


ADAGRAD = Adagrad(lr=0.1)
SGD_HALF = SGD(lr=0.5)


def emb_spec(opt: Optimizer = ADAGRAD, dim: int = 4, dtype: str = "float32") -> EmbeddingSpec:
    return EmbeddingSpec("emb", dim, dtype, Uniform(-0.1, 0.1), opt, 5)


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# ---- embedding tables -------------------------------------------------------


def test_pull_returns_deterministic_rows_one_per_id_without_storing_them() -> None:
    spec = emb_spec()
    table = EmbeddingTable(spec)
    rows = table.pull(ids(9, -4, 9, 2**40))
    assert rows.shape == (4, 4) and rows.dtype == np.float32
    assert len(table) == 0  # reads never change the table
    want = generate(spec.init, spec.seed, ids(9, -4, 9, 2**40), 4, "float32")
    assert np.array_equal(rows, want)
    rows[:] = 0  # a fresh array: writing to it leaves the table alone
    assert np.array_equal(table.pull(ids(9)), want[:1])


def test_growth_keeps_rows_and_state() -> None:
    table = EmbeddingTable(emb_spec(Adam(lr=0.01)))
    table.push(ids(1, 2), np.ones((2, 4), dtype=np.float32))
    before = table.pull(ids(1, 2))
    table.push(np.arange(10, 5000, dtype=np.int64), np.zeros((4990, 4), dtype=np.float32))
    assert len(table) == 4992
    assert np.array_equal(table.pull(ids(1, 2)), before)
    exported = table.export()
    assert exported["step"][:2, 0].tolist() == [1.0, 1.0]
    assert table.pull(ids(7)).shape == (1, 4) and len(table) == 4992
    assert table.nbytes >= 4992 * 4 * 4 * 3


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_duplicate_ids_are_summed_before_one_update(opt: Optimizer) -> None:
    rng = np.random.default_rng(0)
    g = rng.normal(size=(5, 3))
    a = EmbeddingTable(emb_spec(opt, dim=3, dtype="float64"))
    b = EmbeddingTable(emb_spec(opt, dim=3, dtype="float64"))
    a.push(ids(7, 8, 7, 9, 7), g)
    b.push(ids(7, 8, 9), np.stack([g[0] + g[2] + g[4], g[1], g[3]]))
    np.testing.assert_allclose(a.pull(ids(7, 8, 9)), b.pull(ids(7, 8, 9)), rtol=1e-12)
    assert a.checksum() != "" and len(a) == 3
    for k in a.export():
        np.testing.assert_allclose(a.export()[k], b.export()[k], rtol=1e-12)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_repeated_existing_ids_are_summed_too(opt: Optimizer) -> None:
    # Rows that exist already take the no-sort path; a repeat among them must
    # still be found and summed, not applied twice or last-write-wins.
    rng = np.random.default_rng(2)
    a = EmbeddingTable(emb_spec(opt, dim=3, dtype="float64"))
    b = EmbeddingTable(emb_spec(opt, dim=3, dtype="float64"))
    for t in (a, b):
        t.push(ids(7, 8, 9), np.ones((3, 3)))
    g = rng.normal(size=(4, 3))
    a.push(ids(9, 7, 8, 9), g)
    b.push(ids(7, 8, 9), np.stack([g[1], g[2], g[0] + g[3]]))
    for k in a.export():
        np.testing.assert_allclose(a.export()[k], b.export()[k], rtol=1e-12)


def test_pushes_after_pulls_of_the_same_batch_match_a_table_that_never_pulled() -> None:
    # A pull's positions are remembered for the push of the same ids; the result
    # must equal a table that looked every push up afresh, also for a reordered
    # batch, a batch with new ids in between, and after a load.
    rng = np.random.default_rng(7)
    a, b = (EmbeddingTable(emb_spec(Adagrad(lr=0.1), dim=3, dtype="float64")) for _ in range(2))
    batch = rng.permutation(5000)[:400].astype(np.int64)
    batches = [batch, batch[::-1].copy(), np.concatenate([batch[:200], np.arange(9000, 9300)])]
    for step in range(12):
        ids = batches[step % 3]
        g = rng.normal(size=(ids.size, 3))
        a.pull(ids)
        a.push(ids, g)
        b._recent.clear()  # the reference looks every push up afresh
        b.push(ids, g)
        if step == 6:
            exported = a.export()
            a = EmbeddingTable(a.spec)
            a.load(exported)
    for k, v in b.export().items():
        np.testing.assert_allclose(a.export()[k], v, rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=10), min_size=1, max_size=6))
def test_any_push_sequence_matches_one_row_at_a_time(batches: list[list[int]]) -> None:
    opt = Adagrad(lr=0.1)
    table = EmbeddingTable(emb_spec(opt, dim=2, dtype="float64"))
    ref: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
    rng = np.random.default_rng(len(batches))
    spec = table.spec
    for batch in batches:
        g = rng.normal(size=(len(batch), 2))
        table.push(np.array(batch, dtype=np.int64), g)
        summed: dict[int, np.ndarray] = {}
        for x, row in zip(batch, g, strict=True):
            summed[x] = summed.get(x, 0) + row
        for x, row in summed.items():
            if x not in ref:
                p0 = generate(spec.init, spec.seed, ids(x), 2, "float64")
                ref[x] = (p0, opt.init_state(1, 2, np.float64))
            p, st_ = ref[x]
            opt.apply(p, row[None, :], st_)
    keys = np.array(sorted(ref), dtype=np.int64)
    want = np.concatenate([ref[int(x)][0] for x in keys])
    np.testing.assert_allclose(table.pull(keys), want, rtol=1e-12)
    assert len(table) == len(ref)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_push_matches_optimizer_on_the_rows(opt: Optimizer) -> None:
    spec = emb_spec(opt, dim=3, dtype="float64")
    table = EmbeddingTable(spec)
    rng = np.random.default_rng(1)
    p = generate(spec.init, spec.seed, ids(3, 1), 3, "float64")
    state = opt.init_state(2, 3, np.float64)
    for _ in range(3):
        g = rng.normal(size=(2, 3))
        table.push(ids(3, 1), g)
        opt.apply(p, g, state)
    np.testing.assert_allclose(table.pull(ids(3, 1)), p, rtol=1e-12)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_lazy_updates_touch_only_pushed_rows(opt: Optimizer) -> None:
    table = EmbeddingTable(emb_spec(opt))
    table.push(np.arange(20, dtype=np.int64), np.ones((20, 4), dtype=np.float32))
    before = table.export()
    table.push(ids(3, 11), np.ones((2, 4), dtype=np.float32))
    after = table.export()
    touched = np.isin(before["ids"], [3, 11])
    changed = ~np.all(before["rows"] == after["rows"], axis=1)
    assert np.array_equal(changed, touched)
    for k in before:
        assert np.array_equal(before[k][~touched], after[k][~touched])


def test_push_creates_missing_rows_from_their_initial_values() -> None:
    spec = emb_spec(SGD(lr=1.0), dtype="float64")
    table = EmbeddingTable(spec)
    table.push(ids(42), np.full((1, 4), 0.5))
    init = generate(spec.init, spec.seed, ids(42), 4, "float64")
    np.testing.assert_allclose(table.pull(ids(42)), init - 0.5)


def test_push_validation() -> None:
    table = EmbeddingTable(emb_spec())
    with pytest.raises(ShapeMismatchError, match=r"'emb'.*\(2, 4\).*\(2, 3\)"):
        table.push(ids(1, 2), np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ShapeMismatchError, match="emb"):
        table.push(ids(1, 2), np.zeros(8, dtype=np.float32))
    with pytest.raises(BadRequestError, match="1-D"):
        table.push(np.zeros((2, 1), dtype=np.int64), np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(BadRequestError, match="NaN"):
        table.push(ids(1), np.full((1, 4), np.nan, dtype=np.float32))
    with pytest.raises(BadRequestError, match="int64"):
        table.pull(np.array([1.5]))
    assert len(table) == 0  # rejected requests create nothing
    table.push(ids(), np.zeros((0, 4), dtype=np.float32))
    assert table.pull(ids()).shape == (0, 4)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-50, 50), max_size=40), st.randoms(use_true_random=False))
def test_checksum_is_independent_of_insertion_order(xs: list[int], rnd: object) -> None:
    spec = emb_spec(Adam(lr=0.01))
    a, b = EmbeddingTable(spec), EmbeddingTable(spec)
    a.push(np.array(xs, dtype=np.int64), np.ones((len(xs), 4), dtype=np.float32))
    shuffled = list(xs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    b.push(np.array(shuffled, dtype=np.int64), np.ones((len(xs), 4), dtype=np.float32))
    assert a.checksum() == b.checksum()
    assert np.array_equal(a.export()["ids"], np.unique(np.array(xs, dtype=np.int64)))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_export_load_round_trip(opt: Optimizer) -> None:
    table = EmbeddingTable(emb_spec(opt))
    rng = np.random.default_rng(2)
    some = rng.integers(-1000, 1000, 300)
    table.push(some, rng.normal(size=(300, 4)).astype(np.float32))
    exported = table.export()
    assert list(exported) == ["ids", "rows", *opt.state_widths(4)]
    copy = EmbeddingTable(emb_spec(opt))
    copy.pull(ids(5000))  # overwritten by load
    copy.load(exported)
    assert copy.checksum() == table.checksum() and len(copy) == len(table)
    table.push(some[:10], np.ones((10, 4), dtype=np.float32))
    copy.push(some[:10], np.ones((10, 4), dtype=np.float32))
    assert copy.checksum() == table.checksum()


def test_load_rejects_malformed_exports() -> None:
    table = EmbeddingTable(emb_spec(SGD()))
    table.pull(ids(1, 2))
    good = table.export()
    before = table.checksum()
    with pytest.raises(BadRequestError, match="keys"):
        table.load({"ids": good["ids"]})
    with pytest.raises(BadRequestError, match="duplicates"):
        table.load({"ids": ids(1, 1), "rows": good["rows"]})
    rows3 = np.zeros((3, 4), dtype=np.float32)
    with pytest.raises(BadRequestError, match="duplicates"):  # not ascending: sorted to see
        table.load({"ids": ids(5, 2, 5), "rows": rows3})
    with pytest.raises(BadRequestError, match="duplicates"):
        table.load({"ids": ids(2, 5, 5), "rows": rows3})
    with pytest.raises(BadRequestError, match="rows"):
        table.load({"ids": good["ids"], "rows": good["rows"].astype(np.float64)})
    assert table.checksum() == before  # a rejected load changes nothing
    table.load({"ids": ids(7, 3, 5), "rows": np.arange(12, dtype=np.float32).reshape(3, 4)})
    np.testing.assert_array_equal(table.pull(ids(3))[0], [4, 5, 6, 7])  # unsorted, distinct


# ---- dense tensors ----------------------------------------------------------


def dense_spec(opt: Optimizer = SGD_HALF, size: int = 10, chunk: int = 4) -> DenseSpec:
    return DenseSpec("w", (size,), "float64", Normal(0.0, 1.0), opt, 3, chunk)


def test_dense_values_match_the_unchunked_tensor() -> None:
    spec = dense_spec()
    t = DenseTensor(spec)
    whole = generate(spec.init, spec.seed, np.arange(10), 1, "float64").ravel()
    touched = {i: t.pull(i) for i in (2, 0, 1)}  # creation order must not matter
    assert np.array_equal(np.concatenate([touched[0], touched[1], touched[2]]), whole)
    assert t.chunks() == [] and len(t) == 0  # untouched chunks are not stored


def test_dense_push_and_errors() -> None:
    t = DenseTensor(dense_spec())
    start = t.pull(2)
    t.push(2, np.array([1.0, 2.0]))
    np.testing.assert_allclose(t.pull(2), start - 0.5 * np.array([1.0, 2.0]))
    with pytest.raises(ShapeMismatchError, match=r"'w' chunk 2.*2 elements.*\(3,\)"):
        t.push(2, np.zeros(3))
    with pytest.raises(ShapeMismatchError, match="'w'"):
        t.push(0, np.zeros((2, 2)))
    for bad in (-1, 3):
        with pytest.raises(BadRequestError, match="chunk"):
            t.pull(bad)
        with pytest.raises(BadRequestError, match="chunk"):
            t.push(bad, np.zeros(4))


def test_a_pulled_dense_chunk_keeps_its_values_while_held() -> None:
    # pull() lends the stored chunk out without a copy (for a zero-copy send); a
    # push while it is held must not change what the holder sees.
    t = DenseTensor(dense_spec(size=8, chunk=8))
    t.push(0, np.ones(8))
    held = t.pull(0)
    before = held.copy()
    assert not held.flags.writeable
    t.push(0, np.ones(8))
    np.testing.assert_array_equal(held, before)
    np.testing.assert_allclose(t.pull(0), before - 0.5)
    # Once nothing holds a view, pushes update the chunk in place (no copy per push).
    del held
    address = t._values[0].ctypes.data
    t.push(0, np.ones(8))
    assert t._values[0].ctypes.data == address
    np.testing.assert_allclose(t.pull(0), before - 1.0)


def test_a_chunk_set_or_imported_keeps_a_held_pull_too() -> None:
    # A chunk written by set_chunk, or by a slot move's import, is stored owning its
    # memory too: a view lent to a reply counts as a reference to it.
    from zps.store.slots import load_chunks

    spec = dense_spec(size=16, chunk=8)
    for how in ("set", "import"):
        store = PartitionStore()
        store.create(spec)
        t = store.dense(spec.name)
        if how == "set":
            t.set_chunk(0, np.arange(8.0))
        else:
            load_chunks(store, spec.to_wire(), [0], [np.arange(8.0)], [{}])
        held = t.pull(0)
        before = held.copy()
        t.push(0, np.ones(8))
        np.testing.assert_array_equal(held, before, err_msg=how)
        np.testing.assert_allclose(t.pull(0), before - 0.5, err_msg=how)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_dense_chunks_live_in_the_given_memory_and_a_lent_one_is_replaced(
    opt: Optimizer,
) -> None:
    """With ``memory`` (a shard's shared memory), chunks are stored there; a push while
    a pulled view is out (a reply lending it) writes the update to a new array from
    that memory, bit for bit what a tensor that lent nothing computes, and leaves the
    view as it was; with no room left, the heap."""
    made: list[weakref.ref[np.ndarray]] = []  # not references: they would count

    def memory(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        if len(made) >= 3:
            return None
        n = int(np.prod(shape)) * dtype.itemsize
        arr = np.ndarray(shape, dtype, buffer=bytearray(n))
        made.append(weakref.ref(arr))
        return arr

    spec = dense_spec(opt, size=16, chunk=8)
    t, plain = DenseTensor(spec, memory), DenseTensor(spec)
    rng = np.random.default_rng(5)
    grads = [rng.normal(0.0, 1.0, 8) for _ in range(4)]
    for x in (t, plain):
        x.push(0, grads[0])
    assert t._values[0] is made[0]()
    held = t.pull(0)
    before = held.copy()
    for x in (t, plain):
        x.push(0, grads[1])
    assert t._values[0] is made[1]()  # a new array, from the memory
    np.testing.assert_array_equal(held, before)
    assert t.pull(0).tobytes() == plain.pull(0).tobytes()
    del held
    for x in (t, plain):
        x.push(0, grads[2])
    assert t._values[0] is made[1]()  # nothing lent: in place
    t.pull(1)
    for x in (t, plain):
        x.push(1, grads[3])  # made[2]
        x.pull(1)
    held = t.pull(1)
    for x in (t, plain):
        x.push(1, grads[0])
    assert all(t._values[1] is not m() for m in made)  # the memory is full: the heap
    for c in (0, 1):
        assert t.pull(c).tobytes() == plain.pull(c).tobytes()
    got, want = t.export(), plain.export()
    assert got.keys() == want.keys()
    assert all(got[k].tobytes() == want[k].tobytes() for k in got)
    del held


def test_dense_adam_counts_one_step_per_chunk_update() -> None:
    spec = dense_spec(Adam(lr=0.1), size=6, chunk=6)
    t = DenseTensor(spec)
    g = np.linspace(-1, 1, 6)
    p = t.pull(0).reshape(1, -1)
    state = spec.optimizer.init_state(1, 6, np.float64)
    for _ in range(3):
        t.push(0, g)
        spec.optimizer.apply(p, g.reshape(1, -1), state)
    np.testing.assert_allclose(t.pull(0), p.ravel(), rtol=1e-12)
    assert t.export()["step"].tolist() == [3.0]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_dense_export_load_round_trip(opt: Optimizer) -> None:
    t = DenseTensor(dense_spec(opt, size=11, chunk=3))
    t.push(3, np.ones(2))
    t.push(0, np.ones(3))
    t.push(2, np.zeros(3))
    copy = DenseTensor(dense_spec(opt, size=11, chunk=3))
    copy.pull(1)
    copy.load(t.export())
    assert copy.chunks() == [0, 2, 3] and copy.checksum() == t.checksum()
    for c in (0, 2, 3):
        assert np.array_equal(copy.pull(c), t.pull(c))
    copy.push(3, np.ones(2))
    t.push(3, np.ones(2))
    assert copy.checksum() == t.checksum()
    assert t.nbytes > 0
    with pytest.raises(BadRequestError, match="values"):
        copy.load({**t.export(), "values": np.zeros(3)})


# ---- partition store --------------------------------------------------------


def test_create_is_idempotent_and_conflicts_name_fields() -> None:
    store = PartitionStore()
    spec = emb_spec()
    assert store.create(spec) is True
    assert store.create(emb_spec()) is False
    with pytest.raises(TableConflictError, match=r"'emb'.*dim.*optimizer"):
        store.create(emb_spec(Adam(), dim=8))
    with pytest.raises(TableConflictError, match="kind"):
        store.create(DenseSpec("emb", (3,), "float32", Zeros(), SGD(), 0, 3))
    assert store.specs() == [spec]


def test_lookup_by_kind() -> None:
    store = PartitionStore()
    store.create(emb_spec())
    store.create(dense_spec())
    assert isinstance(store.embedding("emb"), EmbeddingTable)
    assert isinstance(store.dense("w"), DenseTensor)
    with pytest.raises(UnknownTableError, match="unknown table 'nope'"):
        store.embedding("nope")
    with pytest.raises(UnknownTableError, match="unknown table 'nope'"):
        store.dense("nope")
    with pytest.raises(BadRequestError, match="'emb'"):
        store.dense("emb")
    with pytest.raises(BadRequestError, match="'w'"):
        store.embedding("w")
    assert [s.name for s in store.specs()] == ["emb", "w"] and "w" in store and len(store) == 2


def test_partition_export_load_and_checksum() -> None:
    a = PartitionStore()
    a.create(dense_spec(Momentum()))
    a.create(emb_spec(FTRL()))
    a.embedding("emb").push(ids(4, 5, 4), np.ones((3, 4), dtype=np.float32))
    a.dense("w").push(1, np.ones(4))
    b = PartitionStore()
    b.create(emb_spec(FTRL()))  # other creation order, replaced by load
    b.load(a.export())
    assert b.checksum() == a.checksum() and b.nbytes == a.nbytes
    c = PartitionStore()
    c.create(emb_spec(FTRL()))
    c.create(dense_spec(Momentum()))
    c.embedding("emb").push(ids(5, 4, 4), np.ones((3, 4), dtype=np.float32))
    c.dense("w").push(1, np.ones(4))
    assert c.checksum() == a.checksum()
    c.dense("w").push(1, np.ones(4))
    assert c.checksum() != a.checksum()


def test_partition_load_is_validated_and_all_or_nothing() -> None:
    a = PartitionStore()
    a.create(emb_spec())
    a.embedding("emb").pull(ids(1))
    before = a.checksum()
    exported = a.export()
    with pytest.raises(BadRequestError):
        a.load({"specs": exported["specs"], "tables": {}})
    with pytest.raises(BadRequestError):
        a.load({"specs": exported["specs"] * 2, "tables": exported["tables"]})
    with pytest.raises(BadRequestError, match="seed"):
        a.load({"specs": [{**exported["specs"][0], "seed": -1}], "tables": exported["tables"]})
    with pytest.raises(BadRequestError):
        a.load([])
    assert a.checksum() == before


def test_huge_but_finite_gradients_are_not_mistaken_for_infinity() -> None:
    # Their float32 squares overflow; the element-wise check must still accept them.
    table = EmbeddingTable(emb_spec(SGD(lr=1e-39)))
    n = 20_000  # x 4 columns: past the size where the sum is checked first
    table.push(np.arange(n, dtype=np.int64), np.full((n, 4), 3e38, dtype=np.float32))
    assert np.all(np.isfinite(table.pull(ids(1, 2, 3))))
    for value in (np.inf, -np.inf, np.nan):
        bad = np.zeros((n, 4), dtype=np.float32)
        bad[n // 2, 1] = value
        with pytest.raises(BadRequestError, match="NaN or infinity"):
            table.push(np.arange(n, dtype=np.int64), bad)
    # Dense chunks take the same check.
    dense = DenseTensor(DenseSpec("big", (100_000,), "float32", Zeros(), SGD(lr=1e-39), 1, 100_000))
    dense.push(0, np.full(100_000, 3e38, dtype=np.float32))
    g = np.zeros(100_000, dtype=np.float32)
    g[-1] = np.nan
    with pytest.raises(BadRequestError, match="NaN or infinity"):
        dense.push(0, g)
