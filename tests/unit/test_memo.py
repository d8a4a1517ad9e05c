"""IdsMemo: answers matched by the ids' content, the tag's identity, within the size range."""

from __future__ import annotations

import numpy as np
import pytest

from zps.core import rows
from zps.core.memo import IdsMemo


def test_matches_by_content_and_tag() -> None:
    memo: IdsMemo[str] = IdsMemo(size=2, min_len=3, max_len=10)
    a = np.array([5, 1, 2, 3], dtype=np.int64)
    tag = object()
    memo.put(a, "a", tag)
    a[1] = 9  # the memo kept its own copy
    assert memo.get(np.array([5, 1, 2, 3]), tag) == "a"
    assert memo.get(a, tag) is None  # same length and first id, other content
    assert memo.get(np.array([5, 1, 2, 3]), object()) is None  # another tag
    assert memo.get(np.array([5, 1, 2, 3])) is None  # no tag


def test_size_range_and_eviction() -> None:
    memo: IdsMemo[int] = IdsMemo(size=2, min_len=3, max_len=5)
    short, long_ = np.arange(2), np.arange(6)
    memo.put(short, 1)
    memo.put(long_, 2)
    assert memo.get(short) is None and memo.get(long_) is None
    for k in range(3):
        memo.put(np.arange(k, k + 4), k)
    assert memo.get(np.arange(0, 4)) is None  # evicted: only the last two are kept
    assert memo.get(np.arange(1, 5)) == 1 and memo.get(np.arange(2, 6)) == 2
    memo.clear()
    assert memo.get(np.arange(2, 6)) is None


@pytest.mark.parametrize("kernel", [False, True] if rows._SAME is not None else [False])
def test_same_ids_compares_content(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled comparison (a memcmp) and numpy's agree, the memo's matches with them."""
    monkeypatch.setattr(rows, "KERNEL", kernel)
    rng = np.random.default_rng(5)
    a = rng.integers(0, 1 << 40, 2048).astype(np.int64)
    assert rows.same_ids(a, a.copy())
    for at in (0, 1, 1024, 2047):  # a difference anywhere, first bytes equal or not
        b = a.copy()
        b[at] ^= 1 << 33
        assert not rows.same_ids(a, b)
    assert not rows.same_ids(a, a[:-1])
    assert rows.same_ids(a[::2], a[::2].copy())  # not contiguous: numpy's comparison
    assert not rows.same_ids(a[::2], a[1::2])
    memo: IdsMemo[str] = IdsMemo(size=4, min_len=3)
    memo.put(a, "a")
    c = a.copy()
    c[-1] += 1  # the same first id and length
    assert memo.get(c) is None and memo.get(a.copy()) == "a"
