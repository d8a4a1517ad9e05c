"""One owner per data directory (zps.ops.datadir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zps.errors import DataDirInUseError
from zps.ops.datadir import lock_data_dir


def test_a_held_directory_is_refused_naming_its_holder(tmp_path: Path) -> None:
    d = tmp_path / "data"
    held = rf"in use by shard s-a \(pid {os.getpid()}\)"
    with lock_data_dir(d, "shard s-a"), pytest.raises(DataDirInUseError, match=held):
        lock_data_dir(d, "shard s-b")
    # Released: the next owner takes it and is named in the file.
    with lock_data_dir(d, "shard s-b"):
        assert (d / "LOCK").read_text() == f"shard s-b (pid {os.getpid()})\n"


def test_a_killed_holder_frees_the_directory(tmp_path: Path) -> None:
    d = tmp_path / "data"
    code = (
        "import os, sys, signal\n"
        "from zps.ops.datadir import lock_data_dir\n"
        f"lock = lock_data_dir({str(d)!r}, 'the broker')\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(DataDirInUseError, match=rf"the broker \(pid {proc.pid}\)"):
            lock_data_dir(d, "shard s-a")
        proc.kill()
        proc.wait(10)
        with lock_data_dir(d, "shard s-a"):
            pass
    finally:
        proc.kill()
        proc.wait(10)
