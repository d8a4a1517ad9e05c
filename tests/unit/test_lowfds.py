"""A shard's memory files take descriptor numbers below its sockets' (zps.store.lowfds),
so that a killed shard's connections close before its tables' pages are freed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, socket
    import numpy as np
    from zps.store import lowfds, mapped

    def memfds():
        out = []
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except FileNotFoundError:
                continue
            if target.startswith("/memfd:zps-rows"):
                out.append(int(name))
        return sorted(out)

    held = lowfds.reserve()
    assert held == lowfds.BLOCK, held
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    conn = socket.create_connection(srv.getsockname())
    sockets = min(srv.fileno(), conn.fileno())
    arrays = [mapped.empty(1 << 16, 32, np.float32) for _ in range(3)]
    frozen = mapped.freeze(arrays[0])
    fds = memfds()
    assert len(fds) == 7, fds  # each array's file and its mapping's copy, and the freeze's
    assert max(fds) < sockets, (fds, sockets)
    frozen.release()
    del frozen, arrays
    import gc; gc.collect()
    assert memfds() == [], memfds()
    # the numbers freed are held again: a new file goes low, and so does a new socket not
    later = [mapped.empty(1 << 16, 32, np.float32)]
    again = socket.create_connection(srv.getsockname())
    assert max(memfds()) < sockets < again.fileno(), (memfds(), sockets, again.fileno())
    print("ok")
    """
)


def test_memory_files_take_numbers_below_the_sockets() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_without_a_reserve_nothing_changes() -> None:
    from zps.store import lowfds

    assert lowfds.low(lambda: 42) == 42
