"""A checkpoint read at a restart: the bytes of tables' arrays in memory files copied
there in the kernel (``mapped.fill_from``) and hashed from a mapping of those files,
the rest read into a buffer; a damaged or short file is refused either way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.specs import EmbeddingSpec
from zps.shard import checkpoint as ckpt
from zps.shard.checkpoint import CheckpointError, CheckpointStore, cut, read_checkpoint
from zps.shard.core import ShardCore
from zps.store import mapped
from zps.store import snapshot as sn
from zps.store.slicereader import SliceReader

pytestmark = pytest.mark.skipif(not mapped.FREEZABLE, reason="memory files: Linux")

ROWS, DIM = 40_000, 8  # rows and Adagrad state of 1.28 MB each: in memory files


def _core() -> ShardCore:
    core = ShardCore()
    core.assign(0, 1)
    core.store.create(EmbeddingSpec("big", DIM, "float32", Zeros(), Adagrad(), 1))
    core.store.create(EmbeddingSpec("small", 4, "float32", Zeros(), Adagrad(), 2))
    rng = np.random.default_rng(0)
    ids = rng.permutation(ROWS).astype(np.int64) * 7
    core.store.embedding("big").push(ids, rng.random((ROWS, DIM), dtype=np.float32))
    core.store.embedding("small").push(ids[:50], np.ones((50, 4), np.float32))
    core.lsn = 9
    return core


@pytest.fixture
def filled(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Slices that end inside frames (so one slice holds both kinds of bytes), and every
    (offset, size) the kernel copied."""
    monkeypatch.setattr(ckpt, "_SLICE", 300_007)
    calls: list[tuple[int, int]] = []
    real = mapped.fill_from

    def fill_from(arr: Any, offset: int, src: int, src_offset: int, size: int) -> int:
        calls.append((src_offset, size))
        return real(arr, offset, src, src_offset, size)

    monkeypatch.setattr(mapped, "fill_from", fill_from)
    return calls


def _written(tmp_path: Path) -> tuple[ShardCore, Path]:
    core = _core()
    return core, CheckpointStore(tmp_path).write(cut(core))


def test_the_rows_are_copied_in_the_kernel_and_load_as_written(
    tmp_path: Path, filled: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    core, path = _written(tmp_path)
    dropped: list[tuple[int, int]] = []
    real_drop = SliceReader.drop

    def drop(self: SliceReader, offset: int, length: int) -> None:
        dropped.append((offset, length))
        real_drop(self, offset, length)

    monkeypatch.setattr(SliceReader, "drop", drop)
    built = sn.build_store(read_checkpoint(path))
    # rows and Adagrad state of "big" (2 x 1.28 MB) went through the kernel copy
    assert sum(n for _, n in filled) == 2 * ROWS * DIM * 4
    assert len(filled) > 2  # in pieces, a slice at a time
    # every slice left the page cache once taken, in order
    size = path.stat().st_size
    assert dropped[0][0] == 0 and sum(n for _, n in dropped) == size
    for name in ("big", "small"):
        want, got = core.store.embedding(name), built.embedding(name)
        ids = want._index.ids()
        assert np.array_equal(got.pull(ids), want.pull(ids))
        assert set(got._state) == set(want._state)
        for key in want._state:  # storage order kept
            assert np.array_equal(got._state[key][: len(got)], want._state[key][: len(want)])


@pytest.mark.parametrize("where", ["rows", "state", "ids", "end"])
def test_a_damaged_byte_is_refused_wherever_it_is_read(
    tmp_path: Path, filled: list[tuple[int, int]], where: str
) -> None:
    _, path = _written(tmp_path)
    read_checkpoint(path)
    data = bytearray(path.read_bytes())
    direct = sorted(filled)
    filled.clear()
    first, last = direct[0][0], direct[-1][0] + direct[-1][1]
    # the rows come first of the bytes copied in the kernel, the state last; ids before
    at = {"rows": first + 5, "state": last - 5, "ids": first - 100, "end": len(data) - 20}[where]
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(path)


def test_a_file_cut_short_in_the_rows_is_refused(
    tmp_path: Path, filled: list[tuple[int, int]]
) -> None:
    _, path = _written(tmp_path)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError):
        read_checkpoint(path)


def test_a_file_that_shrinks_while_read_is_an_end_of_file(
    tmp_path: Path, filled: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size is taken at the open: the kernel copy that comes short is a truncation."""
    _, path = _written(tmp_path)
    real = mapped.fill_from

    def shrink_then_fill(arr: Any, offset: int, src: int, src_offset: int, size: int) -> int:
        os.truncate(path, src_offset + size // 2)
        return real(arr, offset, src, src_offset, size)

    monkeypatch.setattr(mapped, "fill_from", shrink_then_fill)
    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint(path)


def test_fill_from_copies_a_file_range_into_an_array_and_stops_at_its_end(tmp_path: Path) -> None:
    arr = mapped.empty(1 << 17, 8, np.uint8)  # 1 MiB: a memory file
    assert mapped.fillable(arr)
    src = tmp_path / "src"
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8)
    src.write_bytes(data.tobytes())
    fd = os.open(src, os.O_RDONLY)
    try:
        assert mapped.fill_from(arr, 4097, fd, 10, 50_000) == 50_000
        assert mapped.fill_from(arr, 0, fd, 99_990, 64) == 10  # the file ended
    finally:
        os.close(fd)
    flat = arr.reshape(-1)
    assert np.array_equal(flat[4097 : 4097 + 50_000], data[10:50_010])
    assert np.array_equal(flat[:10], data[99_990:])
    with mapped.read_window(arr, 4097, 50_000) as view:
        assert bytes(view) == data[10:50_010].tobytes()
    with pytest.raises(ValueError):
        mapped.fill_from(arr, arr.nbytes - 1, 0, 0, 2)
    plain = np.zeros((4, 4), np.uint8)
    assert not mapped.fillable(plain)
    with pytest.raises(ValueError):
        mapped.fill_from(plain, 0, 0, 0, 1)
