"""A frozen version released range by range as its reader passes
(zps.store.mapped.Frozen.release_to): the pages written in a released range are copied
back and held no longer, the rest stays frozen."""

from __future__ import annotations

import os

import numpy as np
import pytest

from zps.store import mapped


def test_a_frozen_version_released_as_a_reader_passes_keeps_the_rest_frozen() -> None:
    rows = 300_000  # 36 MiB of (rows, 32) float32
    holder = {"a": mapped.empty(rows, 32, np.float32)}
    holder["a"][:] = 1.0
    version = mapped.freeze(holder["a"])
    assert version is not None
    holder["a"][:] += 1.0  # every page written while frozen: each a private copy
    half = holder["a"].nbytes // 2
    assert version.release_to(half) >= half - 4096  # the written pages of the first half
    # The first half is shared with the file again (its writes copied back), the rest
    # still reads the version of the freeze.
    back = np.empty(1024, np.float32)
    os.preadv(version.fd, [back.data.cast("B")], 0)
    np.testing.assert_array_equal(back, 2.0)
    tail = np.empty(1024, np.float32)
    version.read_into(holder["a"].nbytes - tail.nbytes, tail.data.cast("B"))
    np.testing.assert_array_equal(tail, 1.0)
    with pytest.raises(ValueError, match="after its release"):
        version.read_into(0, tail.data.cast("B"))
    holder["a"][:10] += 1.0  # written where released: straight into the file
    assert version.release_to(half) == 0  # nothing left there to copy back
    want = holder["a"].copy()
    assert sum(version.release_steps(16 << 20)) >= half - 4096  # the rest, as before
    assert mapped.frozen(holder["a"]) is None
    np.testing.assert_array_equal(holder["a"], want)
