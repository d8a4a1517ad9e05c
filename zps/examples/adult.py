"""The UCI Adult model that ``zps-server demo`` trains through the parameter server.

One job: turn the packaged Adult census data into hashed feature ids plus a small numeric
matrix, and train a factorization machine on it whose parameters live on a parameter server.

Invariants:
- Featurization is deterministic across processes: feature ids are a keyed blake2b hash of
  ``(field, value)`` (never Python's ``hash()``), and the train/test split is exactly
  ``numpy.random.default_rng(0).permutation(48842)``, first 39,073 rows for training.
- Every worker that trains on the same data with the same ``seed`` sees the same shuffled order
  per epoch and takes its strided share of it, so the workers together cover every training row
  once per epoch.
- The training step is vectorised numpy: one pull of rows, one pull of the dense tensor, a
  forward/backward pass with hand-written gradients of the mean binary cross-entropy, one push
  of rows and one push of the dense gradient (four round trips per batch).

Model (a factorization machine with a numeric linear part)::

    logit = b + x . w_num + sum_f w_f + 1/2 * sum_k [(sum_f v_fk)^2 - sum_f v_fk^2]

where ``f`` runs over the ``n_fields`` hashed feature ids of a row. Each id owns one row of the
embedding table ``{prefix}/emb`` of width ``1 + FM_DIM``: column 0 is its linear weight ``w_f``,
the rest its factor vector ``v_f``. The dense tensor ``{prefix}/dense`` holds ``w_num`` followed
by the bias ``b``. Both use Adam on the server (per-row step counts keep lazy updates of
rare ids correctly bias-corrected).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "CATEGORICAL_FIELDS",
    "FM_DIM",
    "NUMERIC_FEATURES",
    "N_ROWS",
    "N_TRAIN",
    "AdultData",
    "ParamServer",
    "Split",
    "accuracy",
    "auc",
    "create_tables",
    "evaluate",
    "feature_id",
    "load_adult",
    "log_loss",
    "predict_logits",
    "train_worker",
]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

N_ROWS = 48842
N_TRAIN = 39073
FM_DIM = 8

CATEGORICAL_FIELDS: tuple[str, ...] = (
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "gender",
    "native-country",
)

# Numeric columns bucketised into one more hashed id each: (column, bucket edges).
_BUCKETS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("age", (20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70)),
    ("hours-per-week", (20, 30, 35, 40, 41, 45, 50, 55, 60, 70)),
    ("educational-num", tuple(float(v) for v in range(2, 17))),
    ("capital-gain", (1, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 10000, 15000, 30000, 99999)),
    ("capital-loss", (1, 1500, 1700, 1800, 1900, 2000, 2200, 2500)),
)

# Numeric columns kept as standardised floats: (column, log1p first?).
NUMERIC_FEATURES: tuple[tuple[str, bool], ...] = (
    ("age", False),
    ("fnlwgt", True),
    ("educational-num", False),
    ("capital-gain", True),
    ("capital-loss", True),
    ("hours-per-week", False),
)

# Training defaults: two async workers reach test AUC ~0.915 (>= 0.905 with margin) with
# 3 epochs of batches of 512 rows, i.e. ~115 steps = ~460 round trips per worker. Adam beat
# Adagrad clearly here (better AUC, and a calibrated final model rather than a jittery one).
DEFAULT_EPOCHS = 3
DEFAULT_BATCH_SIZE = 512
DEFAULT_LR = 0.01
DEFAULT_INIT_STD = 0.01
DEFAULT_L2 = 0.0
_PROGRESS_EVERY = 20


class ParamServer(Protocol):
    """The blocking parameter-server client surface the model uses (``zps.connect_sync``)."""

    def create_dense(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: str = ...,
        *,
        init: Any = ...,
        optimizer: Any = ...,
    ) -> Any: ...

    def create_embedding(
        self,
        name: str,
        dim: int,
        dtype: str = ...,
        *,
        init: Any = ...,
        optimizer: Any = ...,
    ) -> Any: ...

    def pull_dense(self, name: str) -> npt.NDArray[Any]: ...

    def push_dense(self, name: str, grad: npt.NDArray[Any]) -> Any: ...

    def pull_rows(self, name: str, ids: I64) -> npt.NDArray[Any]: ...

    def push_rows(self, name: str, ids: I64, grads: npt.NDArray[Any]) -> Any: ...


@dataclass(frozen=True, eq=False)
class Split:
    """One part of the data: ``cat_ids`` (n, n_fields) int64, ``numeric`` (n, n_num) float32,
    ``label`` (n,) float32 in {0, 1}."""

    cat_ids: I64
    numeric: F32
    label: F32

    def __len__(self) -> int:
        return int(self.label.shape[0])


@dataclass(frozen=True, eq=False)
class AdultData:
    """The featurized Adult data, split into train (39,073 rows) and test (9,769 rows)."""

    train: Split
    test: Split
    fields: tuple[str, ...]
    numeric_names: tuple[str, ...]

    @property
    def n_fields(self) -> int:
        return len(self.fields)

    @property
    def n_numeric(self) -> int:
        return len(self.numeric_names)


# --------------------------------------------------------------------------- featurization


def feature_id(field: str, value: str) -> int:
    """The stable int64 id of ``field=value`` (a 64-bit keyed blake2b hash)."""
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8, key=field.encode("utf-8"))
    return int.from_bytes(digest.digest(), "little", signed=True)


def _hash_column(field: str, values: Sequence[str]) -> I64:
    uniq, inverse = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    table = np.array([feature_id(field, str(v)) for v in uniq], dtype=np.int64)
    return table[inverse.reshape(-1)]


def _read_columns(path: str | os.PathLike[str] | None) -> dict[str, list[str]]:
    if path is None:
        raw = resources.files("zps.examples").joinpath("data/adult.csv.gz").read_bytes()
    else:
        with open(path, "rb") as f:
            raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    reader = csv.reader(io.StringIO(raw.decode("utf-8")))
    header = [h.strip() for h in next(reader)]
    rows = [r for r in reader if r]
    columns: dict[str, list[str]] = {}
    for j, name in enumerate(header):
        columns[name] = [r[j].strip() for r in rows]
    return columns


def _parse_labels(values: Sequence[str]) -> F32:
    cleaned = [v.strip().rstrip(".").strip() for v in values]
    bad = {v for v in cleaned if v not in ("<=50K", ">50K")}
    if bad:
        raise ValueError(f"unexpected income labels: {sorted(bad)[:5]}")
    return np.array([v == ">50K" for v in cleaned], dtype=np.float32)


def _numbers(values: Sequence[str]) -> F64:
    return np.array([float(v) if v not in ("", "?") else np.nan for v in values], dtype=np.float64)


def load_adult(path: str | os.PathLike[str] | None = None) -> AdultData:
    """Load and featurize the Adult data (default: the copy packaged in ``zps/examples/data``)."""
    cols = _read_columns(path)
    label = _parse_labels(cols["income"])
    if label.size != N_ROWS:
        raise ValueError(f"expected {N_ROWS} rows, found {label.size}")

    ids = [_hash_column(field, cols[field]) for field in CATEGORICAL_FIELDS]
    fields = list(CATEGORICAL_FIELDS)
    for name, edges in _BUCKETS:
        x = _numbers(cols[name])
        bucket = np.where(np.isnan(x), -1, np.digitize(x, np.asarray(edges, dtype=np.float64)))
        ids.append(_hash_column(name + "#bucket", [str(b) for b in bucket.tolist()]))
        fields.append(name + "#bucket")
    cat_ids = np.stack(ids, axis=1).astype(np.int64)

    raw_num = np.stack(
        [
            np.log1p(_numbers(cols[c])) if use_log else _numbers(cols[c])
            for c, use_log in NUMERIC_FEATURES
        ],
        axis=1,
    )

    perm = np.random.default_rng(0).permutation(N_ROWS)
    train_idx, test_idx = perm[:N_TRAIN], perm[N_TRAIN:]
    # Standardise with training statistics only; missing values become the mean (0).
    mean = np.nanmean(raw_num[train_idx], axis=0)
    std = np.nanstd(raw_num[train_idx], axis=0)
    std = np.where(std > 0, std, 1.0)
    numeric = np.nan_to_num((raw_num - mean) / std).astype(np.float32)

    def part(idx: npt.NDArray[np.intp]) -> Split:
        return Split(
            cat_ids=np.ascontiguousarray(cat_ids[idx]),
            numeric=np.ascontiguousarray(numeric[idx]),
            label=np.ascontiguousarray(label[idx]),
        )

    return AdultData(
        train=part(train_idx),
        test=part(test_idx),
        fields=tuple(fields),
        numeric_names=tuple(c for c, _ in NUMERIC_FEATURES),
    )


# --------------------------------------------------------------------------- metrics


def auc(labels: npt.ArrayLike, scores: npt.ArrayLike) -> float:
    """Area under the ROC curve (Mann-Whitney U with mid-ranks for ties)."""
    y = np.asarray(labels).reshape(-1) > 0.5
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError("labels and scores differ in length")
    n_pos = int(y.sum())
    n_neg = int(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # Mid-rank of each group of tied scores (ranks are 1-based).
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]
    mid = (starts + ends + 1) / 2.0
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(mid, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def accuracy(labels: npt.ArrayLike, scores: npt.ArrayLike, threshold: float = 0.0) -> float:
    """Fraction of rows whose ``score > threshold`` matches the label (scores are logits)."""
    y = np.asarray(labels).reshape(-1) > 0.5
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    return float(np.mean((s > threshold) == y))


def log_loss(labels: npt.ArrayLike, logits: npt.ArrayLike) -> float:
    """Mean binary cross-entropy of ``logits``, computed stably."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


# --------------------------------------------------------------------------- model


def _names(prefix: str) -> tuple[str, str]:
    return f"{prefix}/emb", f"{prefix}/dense"


def create_tables(
    ps: ParamServer,
    prefix: str = "adult",
    *,
    n_numeric: int = len(NUMERIC_FEATURES),
    lr: float = DEFAULT_LR,
) -> None:
    """Create the model's tables (idempotent: every worker calls it with the same spec)."""
    from zps import init, optim

    emb, dense = _names(prefix)
    ps.create_embedding(
        emb,
        dim=1 + FM_DIM,
        dtype="float32",
        init=init.Normal(mean=0.0, std=DEFAULT_INIT_STD),
        optimizer=optim.Adam(lr=lr),
    )
    ps.create_dense(
        dense,
        shape=(n_numeric + 1,),
        dtype="float32",
        init=init.Zeros(),
        optimizer=optim.Adam(lr=lr),
    )


def _forward(rows: F32, inverse: I64, numeric: F32, dense: F32) -> tuple[F64, F64, F64]:
    """Logits of a batch, plus the gathered per-field rows and the factor sums for backward."""
    b, n_fields = numeric.shape[0], inverse.shape[1]
    e = rows.astype(np.float64)[inverse.reshape(-1)].reshape(b, n_fields, 1 + FM_DIM)
    w = e[:, :, 0]
    v = e[:, :, 1:]
    s = v.sum(axis=1)  # (b, k)
    pair = 0.5 * (np.einsum("bk,bk->b", s, s) - np.einsum("bfk,bfk->b", v, v))
    d = dense.astype(np.float64)
    logit = d[-1] + numeric.astype(np.float64) @ d[:-1] + w.sum(axis=1) + pair
    return logit, e, s


def _backward(
    logit: F64,
    e: F64,
    s: F64,
    label: F32,
    inverse: I64,
    n_unique: int,
    numeric: F32,
) -> tuple[F32, F32]:
    """Gradients of the mean BCE w.r.t. the unique rows and the dense tensor."""
    b, n_fields = inverse.shape
    p = 0.5 * (1.0 + np.tanh(0.5 * logit))  # stable sigmoid
    g = (p - label.astype(np.float64)) / b  # d mean-loss / d logit, (b,)
    ge = np.empty_like(e)
    ge[:, :, 0] = g[:, None]
    ge[:, :, 1:] = g[:, None, None] * (s[:, None, :] - e[:, :, 1:])
    grows = np.zeros((n_unique, 1 + FM_DIM), dtype=np.float64)
    np.add.at(grows, inverse.reshape(-1), ge.reshape(b * n_fields, 1 + FM_DIM))
    gdense = np.empty(numeric.shape[1] + 1, dtype=np.float64)
    gdense[:-1] = numeric.astype(np.float64).T @ g
    gdense[-1] = g.sum()
    return grows.astype(np.float32), gdense.astype(np.float32)


def _batch_grads(
    rows: F32,
    inverse: I64,
    numeric: F32,
    label: F32,
    dense: F32,
    l2: float,
) -> tuple[float, F32, F32]:
    """Mean loss of a batch and the gradients (rows of the unique ids, dense tensor).

    ``rows`` are the pulled rows of the batch's unique ids; ``inverse`` (b, n_fields) indexes
    them. ``l2`` adds ``l2 * row`` to the gradient of every touched row.
    """
    logit, e, s = _forward(rows, inverse, numeric, dense)
    grows, gdense = _backward(logit, e, s, label, inverse, rows.shape[0], numeric)
    if l2:
        grows += np.float32(l2) * rows
    loss = log_loss(label, logit)
    return loss, grows, gdense


def train_worker(
    ps: ParamServer,
    data: AdultData,
    *,
    worker_index: int = 0,
    n_workers: int = 1,
    epochs: int = DEFAULT_EPOCHS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    prefix: str = "adult",
    progress: Callable[[dict[str, float]], None] | None = None,
    seed: int = 0,
    lr: float = DEFAULT_LR,
    l2: float = DEFAULT_L2,
    create: bool = True,
) -> dict[str, float]:
    """Train on this worker's strided share of every epoch; return the final metrics.

    Each step pulls the rows of the batch's unique ids and the dense tensor, computes the
    gradients of the mean loss and pushes them (four round trips). ``progress`` receives
    ``{"epoch", "step", "loss", "rows"}`` every 20 steps and after the last step (``loss`` is
    the mean batch loss of the last 20 steps, ``rows`` this worker's rows so far).

    ``create`` makes the tables first (with ``lr``; idempotent on the server), ``l2`` adds an
    L2 penalty to the gradient of every touched embedding row. The returned dict holds
    ``epochs``, ``steps``, ``rows``, ``loss``, ``round_trips`` and ``seconds``.
    """
    if not 0 <= worker_index < n_workers:
        raise ValueError(f"worker_index {worker_index} not in [0, {n_workers})")
    if create:
        create_tables(ps, prefix, n_numeric=data.n_numeric, lr=lr)
    train = data.train
    step = 0
    rows_done = 0
    recent: list[float] = []
    last_loss = float("nan")
    started = time.perf_counter()
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(len(train))[
            worker_index::n_workers
        ]
        for start in range(0, order.size, batch_size):
            idx = order[start : start + batch_size]
            loss = train_step(ps, train, idx, prefix, l2)
            step += 1
            rows_done += int(idx.size)
            recent.append(loss)
            last_loss = float(np.mean(recent[-_PROGRESS_EVERY:]))
            if progress is not None and step % _PROGRESS_EVERY == 0:
                progress(
                    {
                        "epoch": float(epoch),
                        "step": float(step),
                        "loss": last_loss,
                        "rows": float(rows_done),
                    }
                )
    if progress is not None and step % _PROGRESS_EVERY != 0:
        progress(
            {
                "epoch": float(epochs - 1),
                "step": float(step),
                "loss": last_loss,
                "rows": float(rows_done),
            }
        )
    return {
        "epochs": float(epochs),
        "steps": float(step),
        "rows": float(rows_done),
        "loss": last_loss,
        "round_trips": float(4 * step),
        "seconds": time.perf_counter() - started,
    }


class TrainingClient(ParamServer, Protocol):
    """What :func:`train_tasks` needs beyond pulls and pushes (``zps.SyncClient``)."""

    @property
    def stop_requested(self) -> bool: ...

    def clock(self) -> int: ...

    def report(self, *, rows: float = 0, loss: float | None = None, **extra: float) -> None: ...

    def create_job(
        self,
        job: str,
        n_records: int,
        per_task: int,
        *,
        epochs: int = ...,
        max_retries: int = ...,
        seed: int = ...,
    ) -> dict[str, Any]: ...

    def next_task(self, job: str) -> Any: ...

    def task_done(self, task: Any) -> None: ...

    def release_task(self, task: Any) -> None: ...


def train_step(
    ps: ParamServer,
    split: Split,
    idx: npt.NDArray[np.int64],
    prefix: str = "adult",
    l2: float = DEFAULT_L2,
) -> float:
    """One step on the rows ``idx``: pull, forward, backward, push; returns the batch loss."""
    emb, dense_name = _names(prefix)
    uniq, inverse = np.unique(split.cat_ids[idx], return_inverse=True)
    inverse = inverse.reshape(idx.size, -1).astype(np.int64)
    rows = np.asarray(ps.pull_rows(emb, uniq), dtype=np.float32)
    dense = np.asarray(ps.pull_dense(dense_name), dtype=np.float32)
    loss, grows, gdense = _batch_grads(
        rows, inverse, split.numeric[idx], split.label[idx], dense, l2
    )
    ps.push_rows(emb, uniq, grows)
    ps.push_dense(dense_name, gdense)
    return loss


def train_tasks(
    ps: TrainingClient,
    data: AdultData,
    *,
    job: str = "adult-train",
    epochs: int = DEFAULT_EPOCHS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    per_task: int = 4096,
    prefix: str = "adult",
    seed: int = 0,
    lr: float = DEFAULT_LR,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train on data tasks handed out by the broker, in the client's training mode.

    Every worker runs this; together they train every record of every epoch
    once, whichever workers come, go or die.  Each batch is one step (pull,
    compute, push, ``clock()``), so the same loop serves async, sync and ssp.
    On ``stop_requested`` the current step finishes and the task goes back.
    """
    create_tables(ps, prefix, n_numeric=data.n_numeric, lr=lr)
    train = data.train
    ps.create_job(job, len(train), per_task, epochs=epochs, seed=seed)
    perms: dict[int, npt.NDArray[np.int64]] = {}
    steps = rows_done = tasks = 0
    started = time.perf_counter()
    loss = float("nan")
    while not ps.stop_requested:
        task = ps.next_task(job)
        if task is None:
            break
        perm = perms.get(task.epoch)
        if perm is None:
            perm = perms[task.epoch] = np.random.default_rng([seed, task.epoch]).permutation(
                len(train)
            )
        order = perm[task.start : task.stop]
        finished = True
        for start in range(0, order.size, batch_size):
            idx = order[start : start + batch_size]
            loss = train_step(ps, train, idx, prefix)
            ps.clock()
            steps += 1
            rows_done += int(idx.size)
            ps.report(rows=idx.size, loss=loss, epoch=task.epoch)
            if on_step is not None:
                on_step(
                    {
                        "rows": float(rows_done),
                        "loss": loss,
                        "epoch": float(task.epoch),
                        "step": float(steps),
                    }
                )
            if ps.stop_requested and start + batch_size < order.size:
                finished = False
                break
        if finished:
            ps.task_done(task)
            tasks += 1
        else:
            ps.release_task(task)
    return {
        "steps": float(steps),
        "rows": float(rows_done),
        "tasks": float(tasks),
        "loss": loss,
        "seconds": time.perf_counter() - started,
    }


def predict_logits(
    ps: ParamServer, split: Split, prefix: str = "adult", batch_size: int = 8192
) -> F64:
    """Logits of every row of ``split``, pulling parameters in batches of ``batch_size`` rows."""
    emb, dense_name = _names(prefix)
    dense = np.asarray(ps.pull_dense(dense_name), dtype=np.float32)
    out = np.empty(len(split), dtype=np.float64)
    for start in range(0, len(split), batch_size):
        sl = slice(start, start + batch_size)
        uniq, inverse = np.unique(split.cat_ids[sl], return_inverse=True)
        inverse = inverse.reshape(split.cat_ids[sl].shape).astype(np.int64)
        rows = np.asarray(ps.pull_rows(emb, uniq), dtype=np.float32)
        out[sl] = _forward(rows, inverse, split.numeric[sl], dense)[0]
    return out


def evaluate(ps: ParamServer, data: AdultData, prefix: str = "adult") -> dict[str, float]:
    """Test-split metrics of the model on the server: ``auc``, ``accuracy``, ``loss``."""
    logits = predict_logits(ps, data.test, prefix)
    label = data.test.label
    return {
        "auc": auc(label, logits),
        "accuracy": accuracy(label, logits),
        "loss": log_loss(label, logits),
    }
