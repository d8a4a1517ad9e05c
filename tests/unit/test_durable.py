"""Durable small files (zps.ops.durable): the new bytes whole and synced with their
folder, or the old file whole and no temporary file left."""

from __future__ import annotations

import errno
import os
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from zps.ops import durable


class CountingOS:
    """An ``os`` that counts the calls made through it, whose ``fail`` call (the
    ``after``-th one) raises ``error``."""

    def __init__(self, fail: str = "", after: int = 1, error: int = errno.EIO) -> None:
        self.calls: Counter[str] = Counter()
        self.synced: list[str] = []
        self.fail, self.after, self.error = fail, after, error

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if not callable(real):
            return real

        def call(*args: Any) -> Any:
            self.calls[name] += 1
            if name == self.fail and self.calls[name] == self.after:
                raise OSError(self.error, os.strerror(self.error))
            if name == "fsync":
                self.synced.append(os.readlink(f"/proc/self/fd/{args[0]}"))
            return real(*args)

        return call


def test_a_write_replaces_the_file_and_syncs_it_then_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = CountingOS()
    monkeypatch.setattr(durable, "os", fs)  # the module's seam
    target = tmp_path / "note"
    target.write_bytes(b"old\n")
    durable.write_atomic(target, b"new\n" * 10_000, mode=0o640)
    assert target.read_bytes() == b"new\n" * 10_000
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 & ~_umask()
    # The temporary file, then the folder (once its new name is in it).
    assert fs.synced == [str(tmp_path / ".note.tmp"), str(tmp_path)]
    assert fs.calls["replace"] == 1 and fs.calls["open"] == fs.calls["close"] == 2
    assert sorted(os.listdir(tmp_path)) == ["note"]


@pytest.mark.parametrize(
    ("fail", "error"),
    [("open", errno.ENOSPC), ("write", errno.ENOSPC), ("fsync", errno.EIO), ("replace", errno.EIO)],
)
def test_a_failed_step_leaves_the_old_file_whole_and_no_temporary_file(
    tmp_path: Path, fail: str, error: int
) -> None:
    target = tmp_path / "note"
    target.write_bytes(b"old\n")
    fs = CountingOS(fail, error=error)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as raised:
        durable.write_atomic(target, b"new\n", fs=fs)
    assert raised.value.errno == error
    assert target.read_bytes() == b"old\n"
    assert sorted(os.listdir(tmp_path)) == ["note"]
    assert len(os.listdir("/proc/self/fd")) == fds  # no descriptor left open
    durable.write_atomic(target, b"new\n", fs=fs)  # writing again is a valid retry
    assert target.read_bytes() == b"new\n"


def test_a_failed_sync_of_the_folder_is_raised_with_the_new_file_in_place(
    tmp_path: Path,
) -> None:
    target = tmp_path / "note"
    fs = CountingOS("fsync", after=2)  # the second: the folder's
    with pytest.raises(OSError):
        durable.write_atomic(target, b"new\n", fs=fs)
    assert target.read_bytes() == b"new\n"
    assert sorted(os.listdir(tmp_path)) == ["note"]


def test_a_partial_temporary_file_a_crash_left_is_replaced(tmp_path: Path) -> None:
    (tmp_path / ".note.tmp").write_bytes(b"torn" * 100)
    durable.write_atomic(str(tmp_path / "note"), b"new\n")
    assert sorted(os.listdir(tmp_path)) == ["note"]
    assert (tmp_path / "note").read_bytes() == b"new\n"


def test_fsync_dir_syncs_the_folder(tmp_path: Path) -> None:
    fs = CountingOS()
    durable.fsync_dir(tmp_path, fs=fs)
    assert fs.synced == [str(tmp_path)] and fs.calls["close"] == 1
    with pytest.raises(FileNotFoundError):
        durable.fsync_dir(tmp_path / "gone")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
