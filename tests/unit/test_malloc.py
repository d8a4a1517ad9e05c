"""Allocator settings: applied on glibc Linux, left alone when the user set glibc's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zps.ops import malloc

CHECK = """
import resource, sys
import numpy as np
from zps.ops import malloc
applied = malloc.tune() if sys.argv[1] == "tune" else False
def rounds():
    for _ in range(50):
        bufs = [np.ones(65536) for _ in range(4)]  # 4 x 512 KiB, as per message
        del bufs
rounds()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 50)
"""


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
