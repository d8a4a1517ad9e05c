"""Bytecode for the fresh interpreters that tests and benchmarks start."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def cache_bytecode(environ: dict[str, str] | os._Environ[str]) -> Path | None:
    """Let the processes started with ``environ`` (brokers, shards, workers, command lines:
    fresh interpreters importing the same modules, hundreds of times) cache their bytecode
    where ``PYTHONDONTWRITEBYTECODE`` would make each compile every module of zps at every
    start, as an installed zps, whose bytecode pip wrote, never does.

    The cache is outside the source tree (``PYTHONPYCACHEPREFIX``), in a directory of this
    user's alone (mode 0700; a path owned by another user or a symlink is not used).
    Nothing changes when bytecode is written anyway or a prefix is already chosen.  Returns
    the prefix set, or None."""
    if not environ.get("PYTHONDONTWRITEBYTECODE") or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    prefix = Path(tempfile.gettempdir()) / f"zps-pycache-{os.getuid()}"
    try:
        prefix.mkdir(mode=0o700, exist_ok=True)
        st = prefix.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    del environ["PYTHONDONTWRITEBYTECODE"]
    return prefix
