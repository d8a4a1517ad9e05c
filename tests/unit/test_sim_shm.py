"""Same-host shared memory (zps.shm, unchanged) in simulated runs: the ``shm`` fault
(zps/testing/sim/shmnet.py, with the real clients, shards and broker).

A run with it turns the path on in every real shard and client: their payload frames
and the replication stream go through each process's arena, read by its peers through
the run's ``/proc/PID/fd/FD``; a region is reused at once as a fault, as if its reader
had been slower than the owner's reclaim time.  The frames go through memory, a killed
process's memory cannot be opened any more, a budget of seeds passes every check, a seed
replays exactly in any process, and a reader that skips the region's token check is
caught (tests/unit/test_sim_client.py, ``shm-token-unchecked``)."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

import pytest

from tests.unit.simcases import Runs, assert_same_run
from zps.core.rows import memory_ordered
from zps.shm import mapper
from zps.shm.region import ShmUnavailableError
from zps.testing.sim import shmnet
from zps.testing.sim.aioloop import PROC, Proc
from zps.testing.sim.cli import main
from zps.testing.sim.faults import FAULTS, NAMED
from zps.testing.sim.world import World

pytestmark = [
    pytest.mark.timeout(300),
    # The path is off on a CPU that reorders memory without the compiled barrier.
    pytest.mark.skipif(not memory_ordered(), reason="shared memory is off on this CPU"),
]

#: The shared memory's fault with the shards' kills, pauses, cuts and slow readers.
SHM_FAULTS = ["shm", "kill", "pause", "partition", "slow"]
#: Seeds of SHM_FAULTS that must pass.
BUDGET = range(0, 8)


def seeds_ahead(sim: Runs) -> None:
    """The runs this module's tests ask for, handed to the pool with the session's first
    test (tests/conftest.py)."""
    sim.ahead(BUDGET, SHM_FAULTS, real_client=True)


def test_shared_memory_is_named_only_and_needs_the_real_shards() -> None:
    assert "shm" in NAMED and "shm" not in FAULTS
    w = World(1, real_client=True)
    shutil.rmtree(w.tmp)
    assert w.shm is None
    with pytest.raises(ValueError, match="needs the real shards"):
        World(1, faults=["shm"])


def test_the_command_line_names_what_the_fault_needs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--stand-in", "--faults", "shm,kill"])
    assert "--faults shm needs the real shards: drop --stand-in" in capsys.readouterr().err


def test_a_run_sends_its_frames_through_shared_memory(
    sim: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = sim.submit(3, ["shm"], real_client=True)
    reads: dict[str, int] = {"ok": 0, "reused": 0}
    real = mapper.Mapper.read_finite

    def read_finite(self: Any, desc: Any, into: Any, itemsize: int) -> Any:
        try:
            got = real(self, desc, into, itemsize)
        except ShmUnavailableError:
            reads["reused"] += 1
            raise
        reads["ok"] += 1
        return got

    monkeypatch.setattr(mapper.Mapper, "read_finite", read_finite)
    w = World(3, faults=["shm"], real_client=True)
    assert w.shm is not None and w.shm.min_bytes == 1
    r = w.run()
    assert r.ok, r.failures[:3]
    # Most pushes' frames went through memory; the regions reused at once were refused
    # (and their messages sent again), never read as other bytes.
    assert reads["ok"] > r.acked, (reads, r.acked)
    assert any("regions of its shared memory reused" in line for line in r.schedule)
    assert reads["reused"] > 0, reads
    # The seams are undone at the end of the run.
    from zps.shm import arena, memory

    assert vars(arena)["os"] is os and vars(mapper)["os"] is os
    assert memory.SharedMemory.__init__.__kwdefaults__["min_bytes"] == memory.MIN_BYTES
    # The same run in a worker process as in this one.
    assert_same_run(r, worker.result())


def test_a_killed_process_memory_cannot_be_opened() -> None:
    sim_os = shmnet.ShmOS(1, lambda name: shmnet.ONE_HOST)
    owner = Proc("s-0")
    fd = owner.context.run(sim_os.memfd_create, "arena")
    pid = owner.context.run(sim_os.getpid)
    try:
        assert pid == shmnet.FIRST_PID
        assert owner.context.run(sim_os.host) == shmnet.ONE_HOST
        inode = sim_os.fstat(fd).st_ino
        path = f"/proc/{pid}/fd/{fd}"
        opened = sim_os.open(path, os.O_RDONLY)
        assert sim_os.fstat(opened).st_ino == inode == sim_os.stat(path).st_ino
        sim_os.close(opened)
        # Another process's descriptor of the same number is not this file.
        other = Proc("c0")
        assert other.context.run(sim_os.getpid) == pid + 1
        with pytest.raises(FileNotFoundError):
            sim_os.open(f"/proc/{pid + 1}/fd/{fd}", os.O_RDONLY)
        owner.alive = False  # killed
        with pytest.raises(FileNotFoundError) as e:
            sim_os.open(path, os.O_RDONLY)
        assert e.value.errno == errno.ENOENT
        with pytest.raises(FileNotFoundError):
            sim_os.stat(path)
    finally:
        sim_os.end()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the run's end
    assert PROC.get() is None


def test_a_budget_of_seeds_passes(sim: Runs) -> None:
    results = sim.passing(BUDGET, SHM_FAULTS, real_client=True)
    assert sum(r.acked for r in results) > 100 * len(results)


def test_shared_memory_with_routers_replays(sim: Runs) -> None:
    faults = ["shm", "routers", "kill", "pause"]
    a = sim.submit(5, faults, real_client=True).result()
    w = World(5, faults=faults, real_client=True)
    assert w.shm_host("s-0") == "h0" and w.shm_host("c0") == shmnet.ONE_HOST
    b = w.run()
    assert a.ok and b.ok, (a.failures[:3], b.failures[:3])
    assert_same_run(a, b)
