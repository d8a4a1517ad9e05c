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


def _present(arr: np.ndarray) -> int:
    """Pages of ``arr`` mapped in this process (/proc/self/pagemap's present bit)."""
    addr, size = arr.__array_interface__["data"][0], arr.nbytes
    first, count = addr // mapped._PAGE, -(-size // mapped._PAGE)
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        raw = os.pread(f.fileno(), count * 8, first * 8)
    entries = np.frombuffer(raw, np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


def test_dropped_pages_keep_their_contents_and_a_frozen_array_is_left_alone() -> None:
    rows = 300_000  # 36 MiB: more than one step
    a = mapped.empty(rows, 32, np.float32)
    a[:] = np.arange(rows, dtype=np.float32)[:, None]
    want = a.copy()
    pages = a.nbytes // mapped._PAGE
    assert _present(a) >= pages - 1
    mapped.drop_pages(a)
    assert _present(a) < pages // 100  # the entries are gone ...
    np.testing.assert_array_equal(a, want)  # ... the contents are not
    # Frozen: its private pages hold the writes since the freeze; none is discarded.
    version = mapped.freeze(a)
    assert version is not None
    a[:] += 1.0
    mapped.drop_pages(a)
    version.release()
    np.testing.assert_array_equal(a, want + 1.0)
    # Plain memory is not a memory file's: left as it is.
    plain = np.ones((1000, 8), np.float32)
    mapped.drop_pages(plain)
    np.testing.assert_array_equal(plain, 1.0)


def test_pages_dropped_on_a_thread_while_the_writer_freezes_grows_and_releases() -> None:
    """drop_pages on another thread, all the time, while the array's writer freezes it,
    writes, releases it range by range and grows it: no write is lost, the frozen
    version always reads what it froze."""
    import threading

    rows = 100_000
    holder = {"a": mapped.empty(rows, 32, np.float32)}
    holder["a"][:] = 0.0
    stop = threading.Event()

    def dropper() -> None:
        while not stop.is_set():
            arr = holder["a"]
            if arr is not None:
                mapped.drop_pages(arr)
            del arr

    t = threading.Thread(target=dropper)
    t.start()
    try:
        for i in range(1, 17):
            a = holder["a"]
            version = mapped.freeze(a)
            assert version is not None
            a[:] += 1.0  # private pages, while the dropper runs
            head = np.empty(8, np.float32)
            version.read_into(0, head.data.cast("B"))
            np.testing.assert_array_equal(head, float(i - 1))
            for _ in version.release_steps(4 << 20):
                pass
            np.testing.assert_array_equal(a[::997], float(i))
            if i % 4 == 0:  # grown in place (or copied) while the dropper runs
                n = a.shape[0]
                del a
                mapped.grow(holder, "a", n + 50_000, n)
                holder["a"][n:] = float(i)
    finally:
        stop.set()
        t.join(10)
    np.testing.assert_array_equal(holder["a"], 16.0)


def test_every_change_of_a_mapping_and_every_drop_holds_the_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule the race above exercises, checked call by call: drop_pages advises only
    with the lock held, and a freeze (shared -> private), a resize and the end of a
    release change a mapping only with it held too (a drop over a private mapping
    discards writes; one over a moved mapping hits other memory)."""
    seen: list[str] = []
    lock = mapped._remapping
    madvise, remap = mapped._libc.madvise, mapped._remap
    resize = mapped._Memory.resize

    def checked_madvise(*args: object) -> int:
        seen.append(f"drop {lock.locked()}")
        return int(madvise(*args))

    def checked_remap(m: object, flags: int, *args: object) -> None:
        if flags == mapped.mmap.MAP_PRIVATE:
            seen.append(f"freeze {lock.locked()}")
        remap(m, flags, *args)  # type: ignore[arg-type]

    def checked_resize(self: object, n: int) -> None:
        seen.append(f"resize {lock.locked()}")
        resize(self, n)  # type: ignore[arg-type]

    monkeypatch.setattr(mapped._libc, "madvise", checked_madvise)
    monkeypatch.setattr(mapped, "_remap", checked_remap)
    monkeypatch.setattr(mapped._Memory, "resize", checked_resize)
    holder = {"a": mapped.empty(100_000, 32, np.float32)}
    holder["a"][:] = 1.0
    mapped.drop_pages(holder["a"])
    version = mapped.freeze(holder["a"])
    assert version is not None
    holder["a"][:] += 1.0
    steps = version.release_steps(4 << 20)
    next(steps)
    steps.close()  # stopped early: the rest at once, at the end of the release
    mapped.grow(holder, "a", 150_000, 100_000)
    assert {"drop True", "freeze True", "resize True"} <= set(seen), seen
    assert not any(entry.endswith("False") for entry in seen), seen
