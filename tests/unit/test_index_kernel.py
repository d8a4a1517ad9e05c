"""The id index's two lookups: the compiled kernel (``zps.store._probe``, optional) and
the numpy fallback give the same positions, and the fallback serves alone when the
kernel is off or was not built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zps.store import index
from zps.store.index import EMPTY, IdIndex

ROOT = Path(__file__).resolve().parents[2]


def _filled(n: int, seed: int) -> tuple[IdIndex, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(EMPTY + 1, 2**63 - 1, n, dtype=np.int64))
    rng.shuffle(ids)
    idx = IdIndex()
    idx.insert(ids)
    return idx, ids


def _queries(ids: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    present = rng.choice(ids, min(ids.size, 3000))
    absent = rng.integers(EMPTY + 1, 2**63 - 1, 300, dtype=np.int64)
    edge = np.array([EMPTY, 0, -1, 2**63 - 1], dtype=np.int64)
    return np.concatenate([present, absent, edge])


def _expected(ids: np.ndarray, queries: np.ndarray) -> list[int]:
    pos = {int(k): i for i, k in enumerate(ids.tolist())}
    return [pos.get(int(q), -1) for q in queries.tolist()]


@pytest.mark.parametrize("n", [1, 7, 1000, 70_000])
def test_numpy_fallback_matches_a_dict(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "KERNEL", False)
    idx, ids = _filled(n, n)
    q = _queries(ids, n + 1)
    assert idx.lookup(q).tolist() == _expected(ids, q)
    assert idx.lookup(q[:3]).tolist() == _expected(ids, q[:3])  # the few-ids path
    assert idx.lookup(np.empty(0, np.int64)).tolist() == []


@pytest.mark.skipif(index._probe is None, reason="the C kernel was not built")
@pytest.mark.parametrize("n", [1, 7, 1000, 70_000])
def test_kernel_matches_the_fallback(n: int) -> None:
    idx, ids = _filled(n, n)
    q = _queries(ids, n + 2)
    for keys in (q, q[:1], q[:3], np.empty(0, np.int64), np.stack([q, q], 1)[:, 0]):
        out = np.empty(keys.shape[0], dtype=np.int64)
        index._probe.lookup(idx._slots, np.ascontiguousarray(keys), out)
        assert out.tolist() == idx.lookup_numpy(keys).tolist() == _expected(ids, keys)


@pytest.mark.skipif(index._probe is None, reason="the C kernel was not built")
def test_kernel_refuses_wrong_buffers() -> None:
    idx, _ = _filled(100, 3)
    keys = np.arange(10, dtype=np.int64)
    with pytest.raises(TypeError):
        index._probe.lookup(idx._slots, keys.astype(np.int32), np.empty(10, np.int64))
    with pytest.raises(ValueError):
        index._probe.lookup(idx._slots, keys, np.empty(9, np.int64))
    with pytest.raises(ValueError):
        index._probe.lookup(idx._slots[:3], keys, np.empty(10, np.int64))
    with pytest.raises((TypeError, BufferError, ValueError)):
        ro = np.empty(10, np.int64)
        ro.flags.writeable = False
        index._probe.lookup(idx._slots, keys, ro)


def test_zps_no_kernel_turns_the_kernel_off() -> None:
    env = {**os.environ, "ZPS_NO_KERNEL": "1", "PYTHONPATH": str(ROOT)}
    code = (
        "import numpy as np; from zps.store import index; assert not index.KERNEL; "
        "i = index.IdIndex(); i.insert(np.arange(50)); "
        "assert i.lookup(np.array([3, 99, 49])).tolist() == [3, -1, 49]"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
