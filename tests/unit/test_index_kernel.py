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

from zps.errors import BadRequestError
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


def _grown(batches: list[np.ndarray], kernel: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    monkeypatch.setattr(index, "KERNEL", kernel)
    idx = IdIndex()
    got = [idx.get_or_insert(b) for b in batches]
    return idx, [(p.tolist(), n) for p, n in got]


@pytest.mark.skipif(index._probe is None, reason="the C kernel was not built")
def test_compiled_insertion_gives_the_fallbacks_positions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches with repeats, ids already present and new ones, through several rehashes:
    the compiled insertion numbers new ids in first-occurrence order as numpy does."""
    rng = np.random.default_rng(11)
    pool = rng.integers(EMPTY + 1, 2**63 - 1, 60_000, dtype=np.int64)
    batches = [rng.choice(pool[: 2_000 * (i + 1)], 4_096) for i in range(30)]
    batches += [np.empty(0, np.int64), pool[:1], np.concatenate([pool[-5:], pool[-5:]])]
    fast, fast_got = _grown(batches, True, monkeypatch)
    slow, slow_got = _grown(batches, False, monkeypatch)
    assert fast_got == slow_got
    assert len(fast) == len(slow) and fast.capacity >= 2 * len(fast)
    assert fast.ids().tolist() == slow.ids().tolist()
    expected = {int(k): i for i, k in enumerate(fast.ids().tolist())}
    assert len(expected) == len(fast)  # each id once
    q = np.concatenate([pool, rng.integers(EMPTY + 1, 2**63 - 1, 500, dtype=np.int64)])
    want = [expected.get(int(k), -1) for k in q.tolist()]
    assert fast.lookup(q).tolist() == want == slow.lookup(q).tolist()
    assert fast.lookup_numpy(q).tolist() == want  # the compiled slots read by numpy too


@pytest.mark.parametrize("kernel", [True, False])
def test_the_empty_sentinel_is_refused_and_nothing_is_inserted(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernel and index._probe is None:
        pytest.skip("the C kernel was not built")
    monkeypatch.setattr(index, "KERNEL", kernel)
    idx = IdIndex()
    idx.get_or_insert(np.arange(10, dtype=np.int64))
    with pytest.raises(BadRequestError, match="sentinel"):
        idx.get_or_insert(np.array([11, EMPTY, 12], dtype=np.int64))
    assert len(idx) == 10
    assert idx.lookup(np.array([11, 12, 3], dtype=np.int64)).tolist() == [-1, -1, 3]


@pytest.mark.skipif(index._probe is None, reason="the C kernel was not built")
def test_compiled_insertion_refuses_what_would_break_the_table() -> None:
    idx = IdIndex()
    idx.insert(np.arange(4, dtype=np.int64))
    with pytest.raises(ValueError, match="already in the index"):
        index._probe.place(idx._slots, np.array([3], np.int64), 4)
    tiny = np.full((2, 2), EMPTY, dtype=np.int64)
    tiny[:, 1] = -1
    index._probe.place(tiny, np.array([7, 8], np.int64), 0)
    with pytest.raises(ValueError, match="index full"):
        index._probe.place(tiny, np.array([9], np.int64), 2)
    out = np.empty(8, np.int64)
    with pytest.raises(ValueError, match="room"):  # ids has no room for 12
        index._probe.get_or_insert(idx._slots, idx._ids, 4, np.arange(100, 108), out)
    ids = np.empty(16, np.int64)
    ids[:4] = np.arange(4)
    with pytest.raises(ValueError, match="room"):  # the load would pass 3/4 (13 of 16)
        index._probe.get_or_insert(idx._slots, ids, 4, np.arange(100, 109), np.empty(9, np.int64))
    # 12 of 16: the most a table takes while the index builds its next one
    assert index._probe.get_or_insert(idx._slots, ids, 4, np.arange(100, 108), out) == 8


@pytest.mark.skipif(index._probe is None, reason="the C kernel was not built")
@pytest.mark.parametrize("n0", [2**63 - 4, 2**63 - 1, 2**62, 9, 5])
def test_compiled_insertion_refuses_a_count_past_the_ids_buffer(n0: int) -> None:
    """A count of ids already there that, with the keys, passes the room in ids (however
    large: no wrap in the check) is refused, and nothing is written."""
    slots = np.full((16, 2), EMPTY, dtype=np.int64)
    slots[:, 1] = -1
    ids = np.zeros(8, np.int64)
    before = slots.copy()
    with pytest.raises(ValueError, match="room for 8 items"):
        index._probe.get_or_insert(slots, ids, n0, np.arange(100, 104), np.empty(4, np.int64))
    assert (slots == before).all() and not ids.any()
    with pytest.raises(ValueError, match="room for 8 items, not the -1"):
        index._probe.get_or_insert(slots, ids, -1, np.arange(100, 104), np.empty(4, np.int64))


@pytest.mark.skipif(index._probe is None, reason="the C kernel was not built")
def test_compiled_placement_refuses_positions_past_int64() -> None:
    slots = np.full((16, 2), EMPTY, dtype=np.int64)
    slots[:, 1] = -1
    with pytest.raises(ValueError, match="int64"):
        index._probe.place(slots, np.arange(100, 104), 2**63 - 2)
    assert (slots[:, 0] == EMPTY).all()
    index._probe.place(slots, np.arange(100, 104), 2**63 - 5)  # the next would be 2**63 - 1
    assert sorted(slots[slots[:, 0] != EMPTY, 1].tolist()) == list(range(2**63 - 5, 2**63 - 1))
