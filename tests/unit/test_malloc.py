"""Allocator settings: applied on glibc Linux, left alone when the user set glibc's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zps import malloc

CHECK = """
import resource, sys
import numpy as np
from zps import malloc
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
