#!/usr/bin/env python3
"""The shard core's cost of one message, with the compiled table kernel on and off.

    python bench/shard_core.py [OPTIMIZER] [ROWS]     # sgd|adagrad|adam|momentum|ftrl, 1000000

A ``ShardCore`` primary handles a pull and then a push of the same N ids (N = 2,048 and
4,096, dim 32 float32, Zipf ids over a table of ROWS rows), and a replica applies the
push alone (``apply_replicated``); no sockets, no processes.  The kernel
(``zps.store._kernel``) and the numpy path take turns in one process: best of 15 blocks
of 40 message pairs each, thread CPU time, printed in microseconds per message pair.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import time  # noqa: E402

import numpy as np  # noqa: E402

from zps.init import Normal  # noqa: E402
from zps.ops import malloc  # noqa: E402
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum  # noqa: E402
from zps.protocol.codec import CompressPolicy, Encoder, MsgType, Route, decode  # noqa: E402
from zps.protocol.specs import EmbeddingSpec  # noqa: E402
from zps.shard.core import ShardCore  # noqa: E402
from zps.store import kernel  # noqa: E402

malloc.tune()

OPT = {
    "sgd": SGD(lr=0.01),
    "adagrad": Adagrad(lr=0.01),
    "adam": Adam(lr=0.001),
    "momentum": Momentum(lr=0.01),
    "ftrl": FTRL(alpha=0.05),
}[sys.argv[1] if len(sys.argv) > 1 else "sgd"]
NROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
SIZES = [2048, 4096]
B, R = 15, 40


def frames(ops, seq):
    enc = Encoder(CompressPolicy(enabled=False))
    wire = [{**op, **{k: enc.array(v) for k, v in arrs.items()}} for op, arrs in ops]
    return [
        bytes(f)
        for f in enc.build(Route(MsgType.REQUEST, 0, 1, 9), {"ops": wire, "cid": b"w", "seq": seq})
    ]


def make_core(primary=True):
    c = ShardCore()
    c.assign(0, 1, primary=primary)
    return c


spec = EmbeddingSpec("e", 32, "float32", Normal(0, 0.01), OPT, 1)
cores = {}
rng = np.random.default_rng(0)
for flag in (False, True):
    kernel.KERNEL = flag
    p, r = make_core(True), make_core(False)
    for c in (p, r):
        m = decode(frames([({"op": "create", "spec": spec.to_wire()}, {})], 1))
        if c.primary:
            c.handle_request(m.route, m.header, m.payloads)
        else:
            c.apply_replicated(m.header, m.payloads)
        t = c.store.embedding("e")
        ids = np.arange(NROWS, dtype=np.int64)
        rng2 = np.random.default_rng(1)
        rng2.shuffle(ids)
        t.set_rows(ids, np.zeros((NROWS, 32), np.float32))
    cores[flag] = (p, r)

seq = [10]


def batch(n):
    ids = np.unique(rng.zipf(1.1, 3 * n) % NROWS)[:n].astype(np.int64)
    if ids.size < n:
        ids = np.unique(np.concatenate([ids, rng.integers(0, NROWS, 2 * n)]))[:n]
    rng.shuffle(ids)
    g = rng.normal(0, 1, (n, 32)).astype(np.float32)
    return ids, g


def run(flag, n, mode):
    kernel.KERNEL = flag
    p, r = cores[flag]
    msgs = []
    for _ in range(R):
        ids, g = batch(n)
        seq[0] += 1
        pull = decode(frames([({"op": "pull_rows", "t": "e"}, {"ids": ids})], seq[0]))
        seq[0] += 1
        push = decode(frames([({"op": "push_rows", "t": "e"}, {"ids": ids, "g": g})], seq[0]))
        msgs.append((pull, push))
    t0 = time.thread_time()
    if mode == "primary":
        for pull, push in msgs:
            p.handle_request(pull.route, pull.header, pull.payloads)
            p.handle_request(push.route, push.header, push.payloads)
    else:
        for _pull, push in msgs:
            r.apply_replicated(push.header, push.payloads)
    return (time.thread_time() - t0) / R * 1e6


for n in SIZES:
    for mode in ("primary", "replica"):
        best = {False: 1e9, True: 1e9}
        for b in range(B):
            for flag in (False, True) if b % 2 == 0 else (True, False):
                best[flag] = min(best[flag], run(flag, n, mode))
        print(
            f"{type(OPT).__name__} rows={NROWS} n={n} {mode}: "
            f"numpy {best[False]:.0f} us, kernel {best[True]:.0f} us"
        )
