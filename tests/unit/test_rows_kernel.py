"""Row routing: the compiled kernel (``zps.core._rows``, optional) and the numpy fallback
give the same splits, gathers and scatters on random data, both match plain numpy
(fancy indexing, ``routing.split_by_partition``), and the fallback serves alone when
the kernel is off or was not built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zps.core import rows
from zps.core.routing import ClusterMap, PartitionInfo, default_slot_map, split_by_partition

ROOT = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(rows._rows is None, reason="the C kernel was not built")


def _cmap(n_slots: int, n_parts: int, seed: int = 0) -> ClusterMap:
    slot_map = default_slot_map(n_slots, n_parts)
    np.random.default_rng(seed).shuffle(slot_map)  # a map after moves, not round-robin
    return ClusterMap(1, n_slots, slot_map, {p: PartitionInfo() for p in range(n_parts)})


def _ids(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True)
    if n > 10:
        ids[: n // 10] = rng.integers(0, 50, n // 10)  # repeats, small and negative ids
        ids[-3:] = [-1, 2**63 - 1, -(2**63)]
    return ids


def _same(a: rows.Split, b: rows.Split) -> None:
    assert a.parts == b.parts
    assert a.order.dtype == b.order.dtype == np.int64
    np.testing.assert_array_equal(a.order, b.order)
    np.testing.assert_array_equal(a.ids, b.ids)


@pytest.mark.parametrize("n_slots", [4096, 1000, 64])
@pytest.mark.parametrize("n_parts", [1, 2, 3, 9, 40])
@pytest.mark.parametrize("n", [0, 1, 5, 4096])
def test_numpy_split_matches_split_by_partition(n_slots: int, n_parts: int, n: int) -> None:
    cmap = _cmap(n_slots, n_parts, seed=n)
    ids = _ids(n, seed=n_parts)
    split = rows.split_ids_numpy(ids, cmap.slot_map, n_parts)
    expected = split_by_partition(ids, cmap)
    assert [p for p, _, _ in split.parts] == [p for p, _ in expected]
    for (_, a, b), (_, pos) in zip(split.parts, expected, strict=True):
        np.testing.assert_array_equal(split.order[a:b], pos)
        np.testing.assert_array_equal(split.ids[a:b], ids[pos])
    assert sum(b - a for _, a, b in split.parts) == n


@needs_kernel
@pytest.mark.parametrize("n_slots", [4096, 1000])
@pytest.mark.parametrize("n_parts", [1, 2, 3, 9, 40])
@pytest.mark.parametrize("n", [0, 1, 5, 4096, 70_000])
def test_kernel_split_matches_numpy(
    n_slots: int, n_parts: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rows, "KERNEL", True)
    cmap = _cmap(n_slots, n_parts, seed=n + 1)
    ids = _ids(n, seed=n_parts + 7)
    _same(
        rows.split_ids(ids, cmap.slot_map, n_parts),
        rows.split_ids_numpy(ids, cmap.slot_map, n_parts),
    )
    # a slot map that is not int32 or not contiguous is converted, not misread
    wide = np.repeat(cmap.slot_map.astype(np.int64), 2)[::2]
    _same(rows.split_ids(ids, wide, n_parts), rows.split_ids_numpy(ids, cmap.slot_map, n_parts))


@needs_kernel
def test_kernel_split_refuses_a_partition_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "KERNEL", True)  # even under ZPS_NO_KERNEL=1
    slot_map = np.array([0, 1, 2, 5], dtype=np.int32)
    ids = np.arange(100, dtype=np.int64)
    with pytest.raises(ValueError, match="partition 5"):
        rows.split_ids(ids, slot_map, 3)
    with pytest.raises(ValueError):
        rows.split_ids_numpy(ids, slot_map, 3)
    with pytest.raises(TypeError):
        rows._rows.split(ids.astype(np.int32), slot_map, ids, ids, np.zeros(6, np.int64))


@pytest.mark.parametrize("dim", [1, 3, 8, 32, 64, 100])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8"])
def test_gather_and_scatter_match_fancy_indexing(
    dim: int, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rows, "KERNEL", rows._rows is not None)
    rng = np.random.default_rng(dim)
    table = (rng.standard_normal((500, dim)) * 100).astype(dtype)
    pos = rng.permutation(500)[:300].astype(np.int64)
    values = (rng.standard_normal((300, dim)) * 100).astype(dtype)
    expected = table.copy()
    expected[pos] = values
    for take, put in (
        (rows.take_rows, rows.put_rows),
        (rows.take_rows_numpy, rows.put_rows_numpy),
    ):
        np.testing.assert_array_equal(take(table, pos), table[pos])
        np.testing.assert_array_equal(take(table, pos[:0]), table[pos[:0]])
        out = table.copy()
        put(out, pos, values)
        np.testing.assert_array_equal(out, expected)
        out = table.copy()
        put(out, pos[::2], values[::2])  # a strided source
        want = table.copy()
        want[pos[::2]] = values[::2]
        np.testing.assert_array_equal(out, want)
        out = table.copy()
        put(out, pos, values.astype(np.float64))  # another dtype: converted like numpy
        np.testing.assert_array_equal(out, expected if dtype != "int8" else out)


@needs_kernel
def test_kernel_checks_positions_and_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows, "KERNEL", True)
    table = np.zeros((10, 4), dtype=np.float32)
    with pytest.raises(IndexError):
        rows.take_rows(table, np.array([0, 10], dtype=np.int64))
    with pytest.raises(IndexError):
        rows.take_rows(table, np.array([-1], dtype=np.int64))
    with pytest.raises(IndexError):
        rows.put_rows(table, np.array([3, 11], dtype=np.int64), np.ones((2, 4), np.float32))
    assert not table.any()  # nothing written before the check failed
    with pytest.raises(ValueError, match="widths"):
        rows._rows.gather(table, np.array([1], dtype=np.int64), np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError, match="widths"):
        rows._rows.scatter(table, np.array([1, 2], dtype=np.int64), np.zeros((2, 3), np.float32))
    with pytest.raises((TypeError, BufferError, ValueError)):
        rows._rows.scatter(
            table[:, :2], np.array([1], dtype=np.int64), np.zeros((1, 2), np.float32)
        )
    readonly = table.copy()
    readonly.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        rows._rows.scatter(readonly, np.array([1], dtype=np.int64), np.zeros((1, 4), np.float32))


def test_no_kernel_environment_turns_it_off() -> None:
    code = "from zps.core import rows; print(rows.KERNEL)"
    env = {**os.environ, "ZPS_NO_KERNEL": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_copy_finite_copies_and_finds_every_nan_and_infinity(
    dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy is the source's bytes, and it is reported finite exactly when numpy's
    isfinite says so, whatever the position (the vector body and the tail) and value
    (the largest finite, denormals and -0.0 are finite)."""
    monkeypatch.setattr(rows, "KERNEL", True)
    info = np.finfo(dtype)
    rng = np.random.default_rng(9)
    size = np.dtype(dtype).itemsize
    for n in (1, 7, 1000, 4099):
        src = rng.normal(0.0, 1.0, n).astype(dtype)
        for at in sorted({0, n // 2, n - 1}):
            for v in (np.nan, np.inf, -np.inf, info.max, -info.max, info.smallest_subnormal, -0.0):
                x = src.copy()
                x[at] = v
                dst = np.full_like(x, 7.0)
                got = rows.copy_finite(dst.view(np.uint8), x.view(np.uint8), size)
                assert got == bool(np.isfinite(x).all()), (n, at, v)
                assert dst.tobytes() == x.tobytes()
    with pytest.raises(ValueError):
        rows._rows.copy_finite(np.empty(8, np.uint8), np.empty(16, np.uint8), 4)
    with pytest.raises(ValueError):
        rows._rows.copy_finite(np.empty(8, np.uint8), np.empty(8, np.uint8), 2)


def test_copy_finite_without_the_kernel_copies_and_knows_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rows, "KERNEL", False)
    src = np.arange(100, dtype=np.float32)
    dst = np.zeros_like(src)
    assert rows.copy_finite(dst.view(np.uint8), src.view(np.uint8), 4) is False
    assert dst.tobytes() == src.tobytes()


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shift", [1, 3, 5])
def test_copy_finite_at_any_byte_offset(
    dtype: type, shift: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Source and copy at byte offsets that are no multiple of the float's size (a
    shared-memory region starts where the peer says): the same bytes and the same verdict
    as aligned buffers give."""
    monkeypatch.setattr(rows, "KERNEL", True)
    size = np.dtype(dtype).itemsize
    rng = np.random.default_rng(shift)
    for n in (1, 9, 4099):
        x = rng.normal(0.0, 1.0, n).astype(dtype)
        for bad in (None, np.nan, -np.inf):
            if bad is not None:
                x[n // 2] = bad
            raw = np.zeros(n * size + 16, np.uint8)
            src = raw[shift : shift + n * size]
            src[:] = x.view(np.uint8)
            out = np.zeros(n * size + 16, np.uint8)
            dst = out[16 - shift : 16 - shift + n * size]
            assert src.ctypes.data % size != 0 and dst.ctypes.data % size != 0
            got = rows.copy_finite(dst, src, size)
            assert got == bool(np.isfinite(x).all()), (n, bad)
            assert dst.tobytes() == x.tobytes()
            assert not out[: 16 - shift].any() and not out[16 - shift + n * size :].any()
            monkeypatch.setattr(rows, "KERNEL", False)  # the fallback: the same bytes
            dst[:] = 0
            assert rows.copy_finite(dst, src, size) is False
            assert dst.tobytes() == x.tobytes()
            monkeypatch.setattr(rows, "KERNEL", True)
