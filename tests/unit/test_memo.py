"""IdsMemo: answers matched by the ids' content, the tag's identity, within the size range."""

from __future__ import annotations

import numpy as np

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
