"""An embedding table's compiled pull and push (``zps.store._kernel``, optional) against
the numpy version: the same pulls and bit for bit the same rows and optimizer state,
for every optimizer, both dtypes, duplicate and absent ids, admission and eviction, and
on replicas re-running a primary's pushes whichever version each side runs.  A dense
tensor's chunk updates, which use the kernel's update too, likewise."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zps.init import Normal, Uniform
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum, Optimizer
from zps.protocol.codec import CompressPolicy, Encoder, MsgType, Route, decode
from zps.protocol.specs import DenseSpec, EmbeddingSpec
from zps.shard.core import ShardCore
from zps.store import kernel
from zps.store.tables import DenseTensor, EmbeddingTable

KERNEL: Any = kernel.COMPILED
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(KERNEL is None, reason="the C kernel was not built")

OPTIMIZERS: list[Optimizer] = [
    SGD(lr=0.1),
    SGD(lr=0.05, clip=0.3, weight_decay=0.01),
    Momentum(lr=0.05, momentum=0.9),
    Momentum(lr=0.05, momentum=0.8, nesterov=True, clip=0.5, weight_decay=0.1),
    Adagrad(lr=0.1),
    Adagrad(lr=0.2, initial_accumulator=0.0, clip=0.2, weight_decay=0.05),
    Adam(lr=0.01),
    Adam(lr=0.02, beta1=0.5, beta2=0.9, clip=1.0, weight_decay=0.01),
    FTRL(alpha=0.1, l1=0.01, l2=0.1),
    FTRL(alpha=0.5, beta=0.0, l1=0.5, clip=0.7),
]
OPT_IDS = [f"{type(o).__name__}-{i}" for i, o in enumerate(OPTIMIZERS)]


class Spy:
    """``kernel.COMPILED`` with its calls and the statuses of ``push`` counted."""

    def __init__(self, kernel: Any) -> None:
        self._k = kernel
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._k, name)

    def pull(self, *args: Any) -> Any:
        self.calls["pull"] += 1
        return self._k.pull(*args)

    def gather(self, *args: Any) -> Any:
        self.calls["gather"] += 1
        return self._k.gather(*args)

    def push(self, *args: Any) -> Any:
        status = self._k.push(*args)
        probe, check, apply = args[4], args[5] is not None, args[12]
        self.calls[f"push probe={probe} check={check} apply={apply} -> {status}"] += 1
        return status


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    s = Spy(KERNEL)
    monkeypatch.setattr(kernel, "COMPILED", s)
    return s


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_export(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert same_bits(a[k], b[k]), k


def workload(seed: int, dim: int, dtype: str, steps: int = 80) -> list[tuple[str, Any, Any]]:
    """Pulls and pushes: batches of distinct ids (pushed right after their pull, as in
    training, or on their own), batches with repeats, absent ids, tiny and empty ones."""
    rng = np.random.default_rng(seed)
    out: list[tuple[str, Any, Any]] = []
    for _ in range(steps):
        kind = rng.integers(0, 6)
        n = int(rng.choice([0, 1, 3, 50, 300, 700]))
        ids = rng.integers(-50, 900, n).astype(np.int64)
        if kind <= 2:
            ids = np.unique(ids)
            rng.shuffle(ids)
        g = rng.normal(0.0, 1.0, (ids.shape[0], dim)).astype(dtype)
        if kind == 0:  # a training step: pull, then push the same (equal, not same) ids
            out.append(("pull", ids, None))
            out.append(("push", ids.copy(), g))
        elif kind == 1:  # pulled twice: the second finds the positions remembered
            out.append(("pull", ids, None))
            out.append(("pull", ids.copy(), None))
        else:
            out.append(("push", ids, g * (10.0 if kind == 5 else 1.0)))
    return out


def replay(
    flag: bool, spec: EmbeddingSpec, ops: list[tuple[str, Any, Any]]
) -> tuple[dict[str, np.ndarray], list[np.ndarray], int]:
    kernel.KERNEL = flag
    t = EmbeddingTable(spec)
    pulled = []
    for what, ids, g in ops:
        if what == "pull":
            pulled.append(t.pull(ids))
        else:
            t.push(ids, g)
    return t.export(), pulled, t.evicted


@pytest.fixture(autouse=True)
def _restore_kernel_flag() -> Any:
    flag = kernel.KERNEL
    yield
    kernel.KERNEL = flag


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_kernel_matches_numpy_bit_for_bit(opt: Optimizer, dtype: str, spy: Spy) -> None:
    spec = EmbeddingSpec("e", 8, dtype, Normal(0.0, 0.1), opt, 3)
    ops = workload(7, 8, dtype)
    got, got_pulls, _ = replay(True, spec, ops)
    want, want_pulls, _ = replay(False, spec, ops)
    assert_same_export(got, want)
    assert len(got_pulls) == len(want_pulls)
    for a, b in zip(got_pulls, want_pulls, strict=True):
        assert same_bits(a, b)
    # every path of the kernel ran: probe + gather, remembered positions, a push
    # of distinct existing rows in one call (probed, or positions remembered from
    # its pull), and absent or repeated ids refused before the update
    calls = spy.calls
    assert calls["pull"] and calls["gather"]
    assert calls["push probe=True check=True apply=True -> 0"]
    assert calls["push probe=False check=True apply=True -> 0"]
    assert calls["push probe=True check=True apply=True -> -1"]
    assert calls["push probe=True check=True apply=True -> -2"]
    assert calls["push probe=False check=False apply=True -> 0"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=OPT_IDS)
def test_dense_chunks_match_numpy_bit_for_bit(opt: Optimizer, dtype: str, spy: Spy) -> None:
    """Chunks of a dense tensor (the last one short), pushed with large, small and
    clipped gradients, and pulled between pushes (a pulled view still out makes the
    update go to a copy)."""
    spec = DenseSpec("d", (1000,), dtype, Normal(0.0, 0.1), opt, 5, 384)
    rng = np.random.default_rng(3)
    pushes = [
        (c, rng.normal(0.0, scale, spec.chunk_range(c)[1] - spec.chunk_range(c)[0]).astype(dtype))
        for scale in (1.0, 0.01, 10.0, 1.0)
        for c in range(spec.n_chunks)
    ]

    def run(flag: bool) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        kernel.KERNEL = flag
        t = DenseTensor(spec)
        pulled = []
        for c, g in pushes:
            view = t.pull(c)  # held across the push: the push must not change it
            t.push(c, g)
            pulled.append(view.copy())
            assert same_bits(view, pulled[-1])
        return t.export(), pulled

    got, got_pulls = run(True)
    kernel_pushes = sum(n for k, n in spy.calls.items() if k.startswith("push"))
    want, want_pulls = run(False)
    assert_same_export(got, want)
    for a, b in zip(got_pulls, want_pulls, strict=True):
        assert same_bits(a, b)
    # Every chunk update ran in the kernel, but Adam's (its steps stay with numpy).
    assert kernel_pushes == (0 if isinstance(opt, Adam) else len(pushes))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow warnings
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("l1", [0.0, 0.01])
def test_ftrl_stores_one_nan_on_both_paths(dtype: str, l1: float, spy: Spy) -> None:
    """Finite gradients whose squares overflow make FTRL's state and rows NaN (inf - inf):
    each NaN is stored as the one quiet NaN (numpy's ``np.nan``), by the kernel and by
    numpy alike, so the two paths stay bit for bit the same."""
    spec = EmbeddingSpec("e", 4, dtype, Normal(0.0, 0.1), FTRL(alpha=0.1, l1=l1, l2=0.1), 3)
    big = float(np.finfo(dtype).max) / 2
    ids = np.arange(6, dtype=np.int64)
    g = np.array([[big, -big, 1.0, 0.0]] * 6, dtype=dtype)
    g[1] = [-big, big, big, 0.0]
    ops = [("pull", ids, None)] + [("push", ids, g)] * 2 + [("push", ids, np.ones_like(g))]
    got, _, _ = replay(True, spec, ops)
    assert spy.calls["push probe=True check=True apply=True -> 0"]
    want, _, _ = replay(False, spec, ops)
    assert_same_export(got, want)
    one_nan = np.array([np.nan], dtype=dtype).tobytes()
    for name in ("rows", "z"):
        nans = got[name][np.isnan(got[name])]
        assert nans.size, name
        assert {x.tobytes() for x in nans} == {one_nan}, name


@pytest.mark.parametrize(
    "life",
    [
        {"admit_count": 3},
        {"admit_probability": 0.4},
        {"ttl_steps": 6},
        {"max_rows": 300},
        {"admit_count": 2, "ttl_steps": 8, "max_rows": 400},
    ],
    ids=["count", "probability", "ttl", "max_rows", "all"],
)
@pytest.mark.parametrize("opt", [Adagrad(lr=0.1), Adam(lr=0.01), FTRL(alpha=0.1, l1=0.01)])
def test_admission_and_eviction_are_unchanged(
    opt: Optimizer, life: dict[str, Any], spy: Spy
) -> None:
    spec = EmbeddingSpec("e", 4, "float32", Uniform(-0.1, 0.1), opt, 5, **life)
    ops = workload(11, 4, "float32", steps=60)
    got, got_pulls, got_evicted = replay(True, spec, ops)
    want, want_pulls, want_evicted = replay(False, spec, ops)
    assert_same_export(got, want)
    assert got_evicted == want_evicted
    for a, b in zip(got_pulls, want_pulls, strict=True):
        assert same_bits(a, b)
    # positions are checked first (no update), then the admitted rows updated
    assert spy.calls["push probe=True check=True apply=False -> 0"]
    assert spy.calls["push probe=False check=False apply=True -> 0"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)], ids=["growing", "saturated"])
def test_adam_steps_beyond_the_tables_and_odd_steps(
    betas: tuple[float, float], dtype: str, spy: Spy
) -> None:
    """Step counts past the kernel's first tables of bias corrections grow them (with
    0.999, 1 - beta2**t is not yet exactly 1 at step 5,000), or use their last entry
    once ``1 - beta**t`` is exactly 1 (with 0.95, from step 400 or so); step counts
    that are not whole numbers (only an import can make them) are left to numpy; all
    as numpy does."""
    opt = Adam(lr=0.01, beta1=betas[0], beta2=betas[1])
    spec = EmbeddingSpec("e", 3, dtype, Normal(0.0, 0.1), opt, 1)
    rng = np.random.default_rng(2)
    ids = np.arange(400, dtype=np.int64)
    steps = rng.choice([0.0, 5.0, 1022.0, 1023.0, 5000.0, 2.0**23, 2.5, 0.5], (400, 1))
    data = {
        "ids": ids,
        "rows": rng.normal(0, 1, (400, 3)).astype(dtype),
        "m": rng.normal(0, 0.1, (400, 3)).astype(dtype),
        "v": rng.random((400, 3)).astype(dtype),
        "step": steps.astype(dtype),
    }
    whole = ids[steps[:, 0] % 1 == 0]
    if betas[1] == 0.999:  # past 2**21 steps, unsaturated tables are not grown
        whole = ids[(steps[:, 0] % 1 == 0) & (steps[:, 0] < 2**21)]
    grads = [rng.normal(0, 1, (whole.shape[0], 3)).astype(dtype) for _ in range(3)]
    last = rng.normal(0, 1, (400, 3)).astype(dtype)
    exports = []
    for flag in (True, False):
        kernel.KERNEL = flag
        t = EmbeddingTable(spec)
        t.load({k: v.copy() for k, v in data.items()})
        for g in grads:
            t.push(whole, g)
        t.push(ids, last)  # the odd ones too
        exports.append(t.export())
    assert_same_export(exports[0], exports[1])
    calls = spy.calls
    assert calls["push probe=True check=True apply=True -> -3"]  # left to numpy
    grown = [k for k in calls if k.endswith(("-> 5002", "-> 5003", "-> 5004"))]
    if betas[1] == 0.999:
        assert grown, calls  # then the push goes on with the positions it found
        assert calls["push probe=False check=False apply=True -> 0"] >= 1
    else:  # saturated: the first tables serve every step count
        assert not grown, calls
        assert calls["push probe=True check=True apply=True -> 0"] == 3


# -- replicas: a primary's pushes re-run, each side with or without the kernel -------


def _frames(ops: list[tuple[dict[str, Any], dict[str, np.ndarray]]], seq: int) -> list[bytes]:
    enc = Encoder(CompressPolicy(enabled=False))
    wire = [{**op, **{k: enc.array(v) for k, v in arrays.items()}} for op, arrays in ops]
    header = {"ops": wire, "cid": b"w1", "seq": seq}
    return [bytes(f) for f in enc.build(Route(MsgType.REQUEST, 0, 1, seq), header)]


def _messages(seed: int) -> list[list[bytes]]:
    specs = [
        EmbeddingSpec("sgd", 8, "float32", Normal(0.0, 0.1), SGD(lr=0.1, clip=0.5), 1),
        EmbeddingSpec("mom", 8, "float32", Normal(0.0, 0.1), Momentum(nesterov=True), 2),
        EmbeddingSpec("ada", 8, "float32", Normal(0.0, 0.1), Adagrad(lr=0.1), 3),
        EmbeddingSpec("adam", 8, "float32", Normal(0.0, 0.1), Adam(weight_decay=0.01), 4),
        EmbeddingSpec("ftrl", 8, "float64", Normal(0.0, 0.1), FTRL(l1=0.01, l2=0.1), 5),
        EmbeddingSpec(
            "life", 8, "float32", Normal(0.0, 0.1), Adam(), 6, admit_count=2, max_rows=200
        ),
    ]
    rng = np.random.default_rng(seed)
    msgs = [_frames([({"op": "create", "spec": s.to_wire()}, {}) for s in specs], 1)]
    for seq in range(2, 60):
        ops: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = []
        for s in specs:
            ids = rng.integers(0, 500, int(rng.choice([1, 20, 300]))).astype(np.int64)
            if rng.random() < 0.6:
                ids = np.unique(ids)
            g = rng.normal(0, 1, (ids.shape[0], 8)).astype(s.dtype)
            if rng.random() < 0.5:
                ops.append(({"op": "pull_rows", "t": s.name}, {"ids": ids}))
            ops.append(({"op": "push_rows", "t": s.name}, {"ids": ids, "g": g}))
        msgs.append(_frames(ops, seq))
    return msgs


@pytest.mark.parametrize(
    ("primary_kernel", "replica_kernel"),
    [(True, True), (True, False), (False, True), (False, False)],
)
def test_replicas_end_bit_identical_to_primaries(
    primary_kernel: bool, replica_kernel: bool
) -> None:
    primary, replica = ShardCore(), ShardCore()
    primary.assign(0, 1, primary=True)
    replica.assign(0, 1, primary=False)
    for frames in _messages(5):
        kernel.KERNEL = primary_kernel
        msg = decode(frames)
        assert primary.handle_request(msg.route, msg.header, msg.payloads).changed
        kernel.KERNEL = replica_kernel
        msg = decode(frames)
        assert replica.apply_replicated(msg.header, msg.payloads) == primary.lsn
    assert replica.store.checksum() == primary.store.checksum()
    assert replica.dedup.entries() == primary.dedup.entries()
    # and the same state as a primary running only numpy
    kernel.KERNEL = False
    ref = ShardCore()
    ref.assign(0, 1, primary=True)
    for frames in _messages(5):
        msg = decode(frames)
        ref.handle_request(msg.route, msg.header, msg.payloads)
    assert ref.store.checksum() == primary.store.checksum()


# -- the kernel's own checks ------------------------------------------------------------


def test_kernel_refuses_wrong_buffers_and_positions() -> None:
    k = KERNEL
    t = EmbeddingTable(EmbeddingSpec("e", 4, "float32", Normal(0.0, 0.1), Adagrad(), 1))
    t.push(np.arange(10, dtype=np.int64), np.ones((10, 4), np.float32))
    slots, rows = t._index._slots, t._rows
    keys = np.arange(3, dtype=np.int64)
    out, pos = np.empty((3, 4), np.float32), np.empty(3, np.int64)
    with pytest.raises(TypeError):
        k.pull(slots, keys.astype(np.int32), rows, out, pos)
    with pytest.raises(ValueError):
        k.pull(slots, keys, rows, np.empty((3, 5), np.float32), pos)
    with pytest.raises(ValueError):
        k.pull(slots[:3], keys, rows, out, pos)
    with pytest.raises(IndexError):
        k.gather(rows, np.array([0, rows.shape[0]], np.int64), np.empty((2, 4), np.float32))
    with pytest.raises(IndexError):
        k.gather(rows, np.array([-1], np.int64), np.empty((1, 4), np.float32))

    def push(pos: np.ndarray, gen: int, **kw: Any) -> int:
        a: dict[str, Any] = {"keys": None, "probe": False}
        a["marks"] = np.zeros(rows.shape[0], np.uint32)
        a |= {"g": np.ones((3, 4), np.float32), "state": (t._state["accumulator"],)} | kw
        return int(
            k.push(t._kopt, slots, a["keys"], pos, a["probe"], a["marks"], gen, a["g"], rows,
                   a["state"], None, None, True)
        )  # fmt: skip

    before = t.export()
    with pytest.raises(IndexError):
        push(np.array([0, 1, rows.shape[0]], np.int64), 1)
    for src in (rows[:-1], np.zeros(rows.shape, np.float64)):  # wrong shape, wrong dtype
        with pytest.raises(ValueError, match="src"):
            k.push(t._kopt, slots, None, keys, False, None, 0, np.ones((3, 4), np.float32),
                   rows, (t._state["accumulator"],), None, None, True, src)  # fmt: skip
    with pytest.raises(ValueError):  # Adagrad has one state array
        push(keys, 2, state=())
    with pytest.raises(ValueError):  # float64 gradients for float32 rows
        push(keys, 3, g=np.ones((3, 4), np.float64))
    with pytest.raises(TypeError):
        push(keys, 4, marks=np.zeros(rows.shape[0], np.int64))
    # absent and repeated ids change nothing
    absent, twice = np.array([1, 2, 99], np.int64), np.array([1, 2, 1], np.int64)
    assert push(np.empty(3, np.int64), 5, keys=absent, probe=True) == k.MISSING
    assert push(np.empty(3, np.int64), 6, keys=twice, probe=True) == k.DUPLICATE
    assert push(twice, 7) == k.DUPLICATE
    assert_same_export(t.export(), before)
    assert push(keys, 8) == k.OK
    assert not same_bits(t.export()["rows"], before["rows"])


def test_zps_no_kernel_turns_the_kernel_off() -> None:
    code = "import zps.store.kernel as k; print(k.KERNEL, k.COMPILED is not None)"
    for env, want in (("1", "False True"), ("", "True True")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "ZPS_NO_KERNEL": env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert out.stdout.split() == want.split()
