"""The Adult demo model (zps.examples.adult) against an in-process fake parameter server.

The fake keeps tables in plain numpy dicts and applies each push on arrival with the real
``zps.optim`` optimizer objects (``init_state``/``apply``) and ``zps.init.generate``, so these
tests need no sockets and no server.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from zps import init as zinit
from zps.examples import adult

# --------------------------------------------------------------------------- fake PS


class FakePS:
    """In-process stand-in for the blocking zps client: the 6 methods, each push applied on
    arrival with the table's real ``zps.optim`` optimizer and ``zps.init`` initializer."""

    def __init__(self) -> None:
        self.specs: dict[str, tuple[Any, ...]] = {}
        self.dense: dict[str, tuple[np.ndarray, Any, dict[str, np.ndarray]]] = {}
        self.tables: dict[str, dict[str, Any]] = {}
        self.calls: dict[str, int] = {}

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def _check_spec(self, name: str, spec: tuple[Any, ...]) -> bool:
        if name in self.specs:
            if self.specs[name] != spec:
                raise ValueError(f"conflicting spec for {name}")
            return False
        self.specs[name] = spec
        return True

    def create_dense(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: str = "float32",
        init: Any = None,
        optimizer: Any = None,
    ) -> None:
        self._count("create")
        if self._check_spec(name, ("dense", tuple(shape), dtype, init, optimizer)):
            size = int(np.prod(shape))
            keys = np.arange(size, dtype=np.int64)
            value = zinit.generate(init, 1, keys, 1, dtype).reshape(shape)
            self.dense[name] = (value, optimizer, optimizer.init_state(size, 1, dtype))

    def create_embedding(
        self,
        name: str,
        dim: int,
        dtype: str = "float32",
        init: Any = None,
        optimizer: Any = None,
    ) -> None:
        self._count("create")
        if self._check_spec(name, ("emb", dim, dtype, init, optimizer)):
            self.tables[name] = {
                "dim": dim,
                "dtype": dtype,
                "init": init,
                "opt": optimizer,
                "index": {},
                "rows": np.zeros((0, dim), dtype),
                "state": optimizer.init_state(0, dim, dtype),
            }

    def pull_dense(self, name: str) -> np.ndarray:
        self._count("pull_dense")
        return self.dense[name][0].copy()

    def push_dense(self, name: str, grad: np.ndarray) -> None:
        self._count("push_dense")
        value, opt, st = self.dense[name]
        assert grad.shape == value.shape and np.isfinite(grad).all()
        opt.apply(value.reshape(-1, 1), np.asarray(grad).reshape(-1, 1), st)

    def _slots(self, name: str, ids: np.ndarray) -> np.ndarray:
        t = self.tables[name]
        index: dict[int, int] = t["index"]
        assert ids.dtype == np.int64 and ids.ndim == 1
        new = [k for k in dict.fromkeys(ids.tolist()) if k not in index]
        if new:
            keys = np.array(new, dtype=np.int64)
            base = t["rows"].shape[0]
            rows = zinit.generate(t["init"], 7, keys, t["dim"], t["dtype"])
            t["rows"] = np.concatenate([t["rows"], rows])
            fresh = t["opt"].init_state(len(new), t["dim"], t["dtype"])
            t["state"] = {k: np.concatenate([t["state"][k], fresh[k]]) for k in fresh}
            for i, k in enumerate(new):
                index[k] = base + i
        return np.fromiter((index[k] for k in ids.tolist()), dtype=np.int64, count=ids.size)

    def pull_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        self._count("pull_rows")
        slots = self._slots(name, ids)  # may grow the table: index it afterwards
        return self.tables[name]["rows"][slots].copy()

    def push_rows(self, name: str, ids: np.ndarray, grads: np.ndarray) -> None:
        self._count("push_rows")
        t = self.tables[name]
        assert grads.shape == (ids.size, t["dim"]) and np.isfinite(grads).all()
        uniq, inv = np.unique(self._slots(name, ids), return_inverse=True)
        summed = np.zeros((uniq.size, t["dim"]), t["dtype"])
        np.add.at(summed, inv.reshape(-1), grads)
        block = t["rows"][uniq]
        st = {k: v[uniq] for k, v in t["state"].items()}
        t["opt"].apply(block, summed, st)
        t["rows"][uniq] = block
        for k, v in st.items():
            t["state"][k][uniq] = v


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def data() -> adult.AdultData:
    return adult.load_adult()


def test_featurization_shapes_and_split(data: adult.AdultData) -> None:
    assert len(data.train) == 39_073
    assert len(data.test) == 9_769
    nf, nn = data.n_fields, data.n_numeric
    for part in (data.train, data.test):
        assert part.cat_ids.dtype == np.int64 and part.cat_ids.shape == (len(part), nf)
        assert part.numeric.dtype == np.float32 and part.numeric.shape == (len(part), nn)
        assert part.label.dtype == np.float32 and set(np.unique(part.label)) == {0.0, 1.0}
        assert np.isfinite(part.numeric).all()
    assert 0.2 < float(data.train.label.mean()) < 0.28
    # Standardised on the training split.
    np.testing.assert_allclose(data.train.numeric.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(data.train.numeric.std(axis=0), 1.0, atol=1e-3)
    # Different fields never share an id.
    all_ids = np.concatenate([data.train.cat_ids, data.test.cat_ids])
    per_field = [set(np.unique(all_ids[:, f]).tolist()) for f in range(nf)]
    assert sum(len(s) for s in per_field) == len(set().union(*per_field))
    assert all(len(s) >= 2 for s in per_field)


def test_featurization_is_deterministic(data: adult.AdultData) -> None:
    again = adult.load_adult()
    np.testing.assert_array_equal(again.train.cat_ids, data.train.cat_ids)
    np.testing.assert_array_equal(again.test.numeric, data.test.numeric)
    np.testing.assert_array_equal(again.test.label, data.test.label)
    assert adult.feature_id("race", "White") == adult.feature_id("race", "White")
    assert adult.feature_id("race", "White") != adult.feature_id("gender", "White")


def test_labels_follow_the_split(data: adult.AdultData) -> None:
    import csv
    import gzip
    from importlib import resources

    raw = resources.files("zps.examples").joinpath("data/adult.csv.gz").read_bytes()
    rows = list(csv.DictReader(gzip.decompress(raw).decode().splitlines()))
    perm = np.random.default_rng(0).permutation(48842)
    expect = np.array([rows[i]["income"].strip().rstrip(".") == ">50K" for i in perm])
    np.testing.assert_array_equal(data.train.label, expect[:39_073])
    np.testing.assert_array_equal(data.test.label, expect[39_073:])
    assert float(data.train.numeric[0, 0]) == pytest.approx(
        (float(rows[perm[0]]["age"]) - np.mean([float(rows[i]["age"]) for i in perm[:39_073]]))
        / np.std([float(rows[i]["age"]) for i in perm[:39_073]]),
        rel=1e-4,
    )


def test_label_variants_and_explicit_path(data: adult.AdultData, tmp_path: Any) -> None:
    """'>50K.' / '<=50K.' (the UCI test file's spelling) parse like the plain labels."""
    import gzip
    from importlib import resources

    raw = gzip.decompress(
        resources.files("zps.examples").joinpath("data/adult.csv.gz").read_bytes()
    )
    lines = raw.decode().splitlines()
    dotted = [lines[0]] + [ln + "." if i % 2 else ln for i, ln in enumerate(lines[1:])]
    path = tmp_path / "adult.csv"
    path.write_text("\n".join(dotted) + "\n")
    again = adult.load_adult(path)
    np.testing.assert_array_equal(again.train.label, data.train.label)
    np.testing.assert_array_equal(again.test.cat_ids, data.test.cat_ids)
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([lines[0], lines[1].replace("<=50K", "maybe")]) + "\n")
    with pytest.raises(ValueError, match="income"):
        adult.load_adult(bad)
    short = tmp_path / "short.csv"
    short.write_text("\n".join(lines[:10]) + "\n")
    with pytest.raises(ValueError, match="48842 rows"):
        adult.load_adult(short)


def _auc_brute(y: np.ndarray, s: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / (pos.size * neg.size))


def test_auc_matches_brute_force_with_ties() -> None:
    rng = np.random.default_rng(3)
    for n in (2, 5, 17, 200):
        y = rng.integers(0, 2, n)
        y[0], y[1] = 0, 1
        s = rng.integers(0, 5, n).astype(np.float64)  # many ties
        assert adult.auc(y, s) == pytest.approx(_auc_brute(y, s), abs=1e-12)
        s2 = rng.normal(size=n)
        assert adult.auc(y, s2) == pytest.approx(_auc_brute(y, s2), abs=1e-12)
    assert adult.auc([0, 1], [0.3, 0.3]) == 0.5
    assert adult.auc([0, 0, 1, 1], [1, 2, 3, 4]) == 1.0
    assert adult.auc([0, 1, 1, 1], [4, 1, 2, 3]) == 0.0
    assert np.isnan(adult.auc([1, 1], [0.1, 0.2]))
    assert adult.accuracy([0, 1, 1], [-1.0, 2.0, -0.5]) == pytest.approx(2 / 3)


def test_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(5)
    b, nf, nn, dim = 6, 4, 3, 1 + adult.FM_DIM
    n_unique = 7
    inverse = rng.integers(0, n_unique, (b, nf)).astype(np.int64)
    inverse[0, :] = 2  # a row repeating one id: the gradient must sum over fields
    rows = rng.normal(0, 0.5, (n_unique, dim)).astype(np.float32)
    numeric = rng.normal(size=(b, nn)).astype(np.float32)
    label = rng.integers(0, 2, b).astype(np.float32)
    dense = rng.normal(0, 0.5, nn + 1).astype(np.float32)

    def loss(r: np.ndarray, d: np.ndarray) -> float:
        logit = adult._forward(r, inverse, numeric, d)[0]
        return adult.log_loss(label, logit)

    got_loss, grows, gdense = adult._batch_grads(rows, inverse, numeric, label, dense, l2=0.0)
    assert got_loss == pytest.approx(loss(rows, dense), rel=1e-9)
    # The model is evaluated in float64 from float32 params: perturb a float64 copy.
    r64, d64 = rows.astype(np.float64), dense.astype(np.float64)
    h = 1e-6
    num_rows = np.zeros_like(r64)
    for i in range(n_unique):
        for j in range(dim):
            p, m = r64.copy(), r64.copy()
            p[i, j] += h
            m[i, j] -= h
            num_rows[i, j] = (loss(p, d64) - loss(m, d64)) / (2 * h)
    num_dense = np.zeros_like(d64)
    for j in range(nn + 1):
        p, m = d64.copy(), d64.copy()
        p[j] += h
        m[j] -= h
        num_dense[j] = (loss(r64, p) - loss(r64, m)) / (2 * h)
    np.testing.assert_allclose(grows, num_rows, atol=1e-6, rtol=1e-4)
    np.testing.assert_allclose(gdense, num_dense, atol=1e-6, rtol=1e-4)
    # L2 adds l2 * row for each touched row.
    _, g2, _ = adult._batch_grads(rows, inverse, numeric, label, dense, l2=0.1)
    np.testing.assert_allclose(g2 - grows, 0.1 * rows, atol=1e-6)


def test_loss_is_stable_for_large_logits() -> None:
    assert adult.log_loss([1.0, 0.0], [1000.0, -1000.0]) == pytest.approx(0.0, abs=1e-12)
    assert adult.log_loss([0.0], [1000.0]) == pytest.approx(1000.0)


def test_create_tables_is_idempotent() -> None:
    ps = FakePS()
    adult.create_tables(ps)
    adult.create_tables(ps)
    assert set(ps.specs) == {"adult/emb", "adult/dense"}


def test_two_interleaved_async_workers_reach_auc(data: adult.AdultData) -> None:
    """Two workers alternate batches (async: each push applied on arrival); AUC >= 0.90."""
    ps = FakePS()
    adult.create_tables(ps)
    seen: list[dict[str, float]] = []

    # Threads in lock-step, one PS call at a time, alternating between the workers: each pulls
    # before the other's push of the same step lands, as in async mode with stale reads.
    turn = threading.Condition()
    state: dict[str, Any] = {"turn": 0, "done": [False, False]}

    class Turn:
        def __init__(self, w: int) -> None:
            self.w = w

        def __getattr__(self, op: str) -> Any:
            target = getattr(ps, op)

            def call(*args: Any, **kwargs: Any) -> Any:
                with turn:
                    turn.wait_for(lambda: state["turn"] == self.w or state["done"][1 - self.w])
                    try:
                        return target(*args, **kwargs)
                    finally:
                        state["turn"] = 1 - self.w
                        turn.notify_all()

            return call

    results: dict[int, dict[str, float]] = {}
    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            results[w] = adult.train_worker(
                Turn(w), data, worker_index=w, n_workers=2, progress=seen.append
            )
        except BaseException as e:
            errors.append(e)
        finally:
            with turn:
                state["done"][w] = True
                turn.notify_all()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    assert set(results) == {0, 1}
    metrics = adult.evaluate(ps, data)
    total_rows = results[0]["rows"] + results[1]["rows"]
    assert total_rows == adult.DEFAULT_EPOCHS * 39_073
    for w in (0, 1):
        assert results[w]["round_trips"] <= 1000
    assert seen and {"epoch", "step", "loss", "rows"} <= set(seen[0])
    print(f"two workers: {metrics} results={results} {elapsed:.1f}s calls={ps.calls}")
    assert metrics["auc"] >= 0.90
    assert metrics["accuracy"] >= 0.84
