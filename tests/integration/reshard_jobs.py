"""A sync-mode worker job for test_live_resharding.py (run by ``zps.worker_entry``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from zps.optim import SGD

N_IDS = 2000


def sync_rows(ps: Any, steps: str, delay: str = "0") -> int:
    """Sync mode: push 1.0 to every element of 2,000 rows (on every slot group) and of a
    dense tensor each step; record the steps seen."""
    ps.create_embedding("sr", dim=2, dtype="float64", optimizer=SGD(lr=1.0))
    ps.create_dense("sw", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
    ids = np.arange(1, N_IDS + 1, dtype=np.int64)
    seen = [ps.step]
    for _ in range(int(steps)):
        if ps.stop_requested:
            break
        ps.push_rows("sr", ids, np.ones((N_IDS, 2)))
        ps.push_dense("sw", np.ones(4))
        seen.append(ps.clock())
        time.sleep(float(delay))
    print(json.dumps({"pid": os.getpid(), "steps": seen}), flush=True)
    return 0
