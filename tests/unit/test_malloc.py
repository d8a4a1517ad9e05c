"""Allocator settings: applied on glibc Linux, left alone when the user set glibc's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zps.ops import malloc

#: Prints the page faults per round of 4 x 512 KiB buffers (as per message), allocated
#: and freed, after a warm-up round.
FAULTS = """
import resource
import numpy as np
def rounds():
    for _ in range(50):
        bufs = [np.ones(65536) for _ in range(4)]
        del bufs
rounds()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 50)
"""

CHECK = (
    """
import sys
from zps.ops import malloc
print(malloc.tune() if sys.argv[1] == "tune" else False)
"""
    + FAULTS
)


def faults_per_round(how: str) -> tuple[bool, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", CHECK, how], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_message_buffers_stay_in_the_process() -> None:
    # glibc's defaults hand 2 MiB back to the kernel every round (512 fresh
    # pages); tuned, the same buffers are reused without a page fault.
    applied, faults = faults_per_round("default")
    assert not applied and faults > 100
    applied, faults = faults_per_round("tune")
    assert applied and faults < 10


@pytest.mark.parametrize("var", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_a_users_own_glibc_setting_wins(var: str) -> None:
    assert malloc.tune({var: "65536"}) is False


TRIM = """
import numpy as np
from zps.ops import malloc

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

assert malloc.trim() is False  # nothing to do before tune()
assert malloc.tune()
keep = [np.ones(1 << 17) for _ in range(40)]  # 40 x 1 MiB from the heap
del keep  # freed, but under the trim threshold: held by the process
held = rss_kib()
assert malloc.trim()
print(held - rss_kib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_trim_hands_freed_buffers_back() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", TRIM], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 30 * 1024  # most of the 40 MiB went back


CLIENT = (
    """
import asyncio, sys
import zps
from zps.errors import ZpsTimeoutError

async def start():
    # Nothing listens there: the client gives up after its introduction, which
    # comes after the allocator's settings.
    try:
        async with zps.connect(sys.argv[1], connect_timeout=0.3, tune_malloc=sys.argv[2] == "1"):
            raise AssertionError("connected to nothing")
    except ZpsTimeoutError:
        pass

asyncio.run(start())
"""
    + FAULTS
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
@pytest.mark.parametrize("tune", [True, False])
def test_a_client_keeps_its_message_buffers_unless_told_not_to(tune: bool) -> None:
    # A training script of the user's own (zps.connect, not zps-worker) gets the
    # settings too: without them a sparse step's buffers cost ~230 page faults.
    from zps.testing import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    address = f"tcp://127.0.0.1:{free_port()}"
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, address, "1" if tune else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    faults = float(out.stdout)
    assert faults < 10 if tune else faults > 100, faults
