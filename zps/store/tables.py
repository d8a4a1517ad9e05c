"""The two kinds of table one partition holds: embedding tables and dense chunks.

Invariants:

- A row or chunk that was never touched has no storage; on first touch it is
  filled by :func:`zps.init.generate` from ``(spec.seed, id)`` (embeddings) or
  ``(spec.seed, flat element index)`` (dense), so every replica and every
  restart materialises identical values.
- Optimizer state sits beside the values, row for row, in the table's dtype,
  and a push updates only the rows (chunks) it names: sparse updates are lazy.
- ``export()`` is canonical: ids (chunks) in ascending order, so two tables
  with the same contents export, and checksum, identically whatever order the
  rows were created in.  ``load(export())`` restores the table exactly.

Pushes take ``(ids, grads)`` as received; duplicates are summed before the
optimizer runs, so an id appearing twice in one push is updated once.

Where the optional C kernel ``zps.store._kernel`` was built, an embedding table's pull
and push run in it (:data:`KERNEL`), and so does a dense chunk's update (but Adam's),
with bit for bit the numpy version's results: rows and state stay where they are, so
exports, snapshots and checkpoints do not change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64_pair
from zps.core.memo import IdsMemo
from zps.core.rows import put_rows, take_rows
from zps.errors import BadRequestError, ShapeMismatchError
from zps.init import generate
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum, Optimizer, at_step
from zps.protocol.specs import DenseSpec, EmbeddingSpec
from zps.store import mapped
from zps.store.index import IdIndex, as_ids

try:  # the compiled pull and push, built by ``pip install`` where a C compiler is found
    from zps.store import _kernel  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _kernel = None

__all__ = ["DenseTensor", "EmbeddingTable", "checksum_arrays"]

Array = npt.NDArray[Any]
TableSpecT = TypeVar("TableSpecT", DenseSpec, EmbeddingSpec)
_GROWTH = 1.5
_MIN_ROWS = 64
#: Writes, and ids, a :class:`WriteLog` holds at most (then it is dropped).
_MAX_DIRTY = 1 << 16
_MAX_DIRTY_IDS = 1 << 22


class WriteLog(list[npt.NDArray[np.int64]]):
    """The ids of every write to an embedding table (push, set, slot import) since it
    was attached (``EmbeddingTable._dirty``): for the drop of released rows in steps,
    and a move's catch-up (zps/store/slots.py).  One that grows past ``_MAX_DIRTY``
    writes or ``_MAX_DIRTY_IDS`` ids is detached (its user starts again)."""

    n_ids = 0

    def take(self) -> npt.NDArray[np.int64]:
        """The distinct ids listed, and an empty list."""
        out = np.unique(np.concatenate(self)) if self else np.zeros(0, dtype=np.int64)
        self.clear()
        self.n_ids = 0
        return out


_UNSHARED = 3  # see DenseTensor.push
_ROW0 = np.zeros(1, dtype=np.int64)  # a dense chunk's one row, for the kernel
_ROW0.setflags(write=False)
#: An embedding table's bookkeeping columns when it admits or evicts rows (their names
#: cannot be an optimizer's state: those are identifiers).
TOUCHED, SEEN = "#touched", "#seen"
#: Whether an embedding table's pull and push use the compiled kernel
#: (``zps.store._kernel``: probe, gather, optimizer and scatter in one call, each row
#: updated in place; bit for bit the numpy version's results).  ``ZPS_NO_KERNEL=1`` in
#: the environment turns it off, as it does the index's compiled lookup.
KERNEL = _kernel is not None and os.environ.get("ZPS_NO_KERNEL", "") in ("", "0")
#: Adam's bias-correction tables (see :func:`_adam_tables`) start with this many steps.
_ADAM_STEPS = 1024


def checksum_arrays(arrays: dict[str, Array], h: Any = None) -> str:
    """sha256 over names, dtypes, shapes and bytes, in the dict's order."""
    h = hashlib.sha256() if h is None else h
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return str(h.hexdigest())


def _float_grads(
    table: str, grads: object, shape: tuple[int, ...], dtype: np.dtype[Any], finite: bool = False
) -> Array:
    """Check a gradient's shape and values (not whether they are finite, when the
    caller knows: ``finite``); return it in the table's dtype."""
    g = np.asarray(grads)
    if g.shape != shape:
        raise ShapeMismatchError(
            f"table {table!r}: expected gradient of shape {shape}, got {g.shape}"
        )
    if g.size and not (np.issubdtype(g.dtype, np.floating) or np.issubdtype(g.dtype, np.integer)):
        raise BadRequestError(f"table {table!r}: gradient dtype must be numeric, got {g.dtype}")
    if g.dtype == dtype:
        if finite:  # known finite in this dtype: nothing to convert or check
            return g
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is checked below
            g = g.astype(dtype)
    # One NaN or inf would poison the rows (and their optimizer state) for every worker.
    # For a large float32/float64 gradient, the BLAS dot product g.g is one pass with
    # no temporary, cheaper than isfinite().all() or a sum (figures: docs/performance.md,
    # "Figures behind the code's rules"); only when it is not finite (a NaN or inf, or
    # huge values whose squares overflowed) does the element-wise check decide.
    if g.size > 65536 and g.dtype.kind == "f" and g.itemsize >= 4 and g.flags.c_contiguous:
        flat = g.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            finite = math.isfinite(float(np.dot(flat, flat))) or bool(np.isfinite(g).all())
    else:
        finite = bool(np.isfinite(g).all()) if g.size else True
    if not finite:
        raise BadRequestError(f"table {table!r}: gradient contains NaN or infinity")
    return g


_KernelOpt = tuple[int, float, float, float, float, float, float, int]


def _fixed(rate: object) -> float:
    """An applied optimizer's rate (:func:`zps.optim.at_step` fixed it)."""
    assert isinstance(rate, float | int), "a scheduled optimizer applied without at_step"
    return float(rate)


def _kernel_opt(opt: object) -> _KernelOpt | None:
    """An applied optimizer (a fixed rate: see :func:`zps.optim.at_step`) as the kernel's
    ``opt`` tuple: ``(kind, clip (0: none), weight_decay, four hyperparameters, flag)``,
    the flag Momentum's ``nesterov`` (for Adam, set with its tables); None if the kernel
    has no such kind."""
    if _kernel is None:
        return None
    if isinstance(opt, SGD):
        return (_kernel.SGD, opt.clip or 0.0, opt.weight_decay, _fixed(opt.lr), 0.0, 0.0, 0.0, 0)
    if isinstance(opt, Momentum):
        return (
            _kernel.MOMENTUM,
            opt.clip or 0.0,
            opt.weight_decay,
            _fixed(opt.lr),
            opt.momentum,
            0.0,
            0.0,
            int(opt.nesterov),
        )
    if isinstance(opt, Adagrad):
        rate = _fixed(opt.lr)
        return (_kernel.ADAGRAD, opt.clip or 0.0, opt.weight_decay, rate, opt.eps, 0.0, 0.0, 0)
    if isinstance(opt, Adam):
        return (
            _kernel.ADAM,
            opt.clip or 0.0,
            opt.weight_decay,
            _fixed(opt.lr),
            opt.beta1,
            opt.beta2,
            opt.eps,
            0,
        )
    if isinstance(opt, FTRL):
        alpha = _fixed(opt.alpha)
        return (_kernel.FTRL, opt.clip or 0.0, 0.0, alpha, opt.beta, opt.l1, opt.l2, 0)
    return None


def _check_retune(old: TableSpecT, new: TableSpecT, reset: bool) -> bool:
    """Whether the state columns are made afresh for ``new`` (``old`` with another
    optimizer or step): with ``reset``, whatever the kind; another kind takes ``reset``."""
    if type(old) is not type(new) or old.name != new.name or old != _with_opt(new, old.optimizer):
        raise BadRequestError(f"table {old.name!r}: only the optimizer and step may change")
    other = type(new.optimizer) is not type(old.optimizer)
    if other and not reset:
        raise BadRequestError(
            f"table {old.name!r}: its optimizer is {old.optimizer.kind}, not "
            f"{new.optimizer.kind}; another kind takes reset_state=True (its state "
            "starts afresh)"
        )
    return reset


def _with_opt(spec: TableSpecT, opt: Optimizer) -> TableSpecT:
    return dataclasses.replace(spec, optimizer=opt)


def _adam_tables(opt: Adam, steps: int, dtype: np.dtype[Any]) -> tuple[Array, Array, bool]:
    """``1 - beta1**t`` and ``1 - beta2**t`` for steps ``t = 0 .. steps - 1``, computed
    exactly as :meth:`zps.optim.Adam.apply` computes them for each row (the same numpy
    call on a column of float steps), so the kernel's bias corrections are the same bits;
    and whether they are saturated: both powers at the last step are below an eighth of
    the dtype's epsilon, so ``1 - beta**t`` is exactly 1 there and at every later step
    (then the tables stop growing, and the kernel uses their last entry)."""
    t = np.arange(steps, dtype=dtype).reshape(-1, 1)
    pow1 = np.power(opt.beta1, t, dtype=dtype)
    pow2 = np.power(opt.beta2, t, dtype=dtype)
    tiny = float(np.finfo(dtype).eps) / 8
    saturated = bool(pow1[-1, 0] < tiny and pow2[-1, 0] < tiny)
    bc1, bc2 = (1.0 - pow1).reshape(-1), (1.0 - pow2).reshape(-1)
    return np.ascontiguousarray(bc1), np.ascontiguousarray(bc2), saturated


def _load_array(
    table: str,
    data: dict[str, Array],
    key: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    *,
    copy: bool = True,
) -> Array:
    if key not in data:
        raise BadRequestError(f"table {table!r}: export lacks {key!r}")
    a = np.asarray(data[key])
    if a.shape != shape or a.dtype != dtype:
        raise BadRequestError(
            f"table {table!r}: export {key!r} has shape {a.shape} dtype {a.dtype}, "
            f"expected {shape} {dtype}"
        )
    return np.array(a, copy=True) if copy else a


class EmbeddingTable:
    """id -> row of ``spec.dim`` values plus optimizer state; rows made on first touch."""

    def __init__(self, spec: EmbeddingSpec) -> None:
        self.spec = spec
        self.dtype: np.dtype[Any] = np.dtype(spec.dtype)
        self._widths = spec.optimizer.state_widths(spec.dim)
        #: Admission and eviction (see the lifecycle notes below): the two columns of
        #: bookkeeping sit beside the optimizer state, so snapshots, checkpoints and
        #: replication carry them like any state.
        self._life = spec.lifecycle
        self._opt_keys = tuple(self._widths)
        if self._life:
            self._widths = {**self._widths, TOUCHED: 1, SEEN: 1}
        self._int = np.dtype(np.int32 if self.dtype.itemsize == 4 else np.int64)
        #: This table's pushes on this partition: the clock of ``ttl_steps`` and LRU.
        self._tick = 0
        self.evicted = 0  # rows evicted since this table was made or loaded (not replicated)
        #: The compiled kernel's view of the optimizer (None: numpy only), its
        #: duplicate-check marks (one per row; a push marks its rows with a new
        #: generation) and, for Adam, its bias-correction tables by step.
        self._opt: Optimizer = at_step(spec.optimizer, spec.step)  # the one applied
        self._kopt: _KernelOpt | None = _kernel_opt(self._opt)
        self._marks: npt.NDArray[np.uint32] = np.zeros(0, dtype=np.uint32)
        self._gen = 0
        self._bc: tuple[Array, Array] | None = None
        #: While the rows of released slots are dropped in steps, or a move copies slots
        #: still served (zps/store/slots.py): the ids of every push, set and import, whose
        #: rows are copied again.  None otherwise.
        self._dirty: WriteLog | None = None
        self._reset(0)

    def _reset(self, capacity: int) -> None:
        cap = max(capacity, _MIN_ROWS)
        self._index = IdIndex()
        self._recent: IdsMemo[npt.NDArray[np.int64]] = IdsMemo()  # see _lookup
        self._stamp: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)  # see _distinct
        self._rows: Array = mapped.empty(cap, self.spec.dim, self.dtype)
        self._state: dict[str, Array] = {
            k: mapped.empty(cap, w, self.dtype) for k, w in self._widths.items()
        }

    def retune(self, spec: EmbeddingSpec, *, reset: bool = False) -> None:
        """Take ``spec``: this table's with another optimizer or step count.  Without
        ``reset`` the same kind of optimizer keeps every row's state, and another kind is
        a BadRequestError naming both; ``reset`` gives every row the new optimizer's
        initial state (the values, and the admission and eviction columns, stay)."""
        if _check_retune(self.spec, spec, reset):
            cap, n = self._rows.shape[0], len(self._index)
            widths = spec.optimizer.state_widths(spec.dim)
            state = {k: mapped.empty(cap, w, self.dtype) for k, w in widths.items()}
            for k, arr in spec.optimizer.init_state(n, spec.dim, self.dtype).items():
                state[k][:n] = arr
            self._opt_keys = tuple(widths)
            if self._life:
                widths = {**widths, TOUCHED: 1, SEEN: 1}
                state[TOUCHED], state[SEEN] = self._state[TOUCHED], self._state[SEEN]
            self._widths, self._state = widths, state
        self.spec = spec
        old, self._opt = self._opt, at_step(spec.optimizer, spec.step)
        kopt = _kernel_opt(self._opt)
        if (
            isinstance(old, Adam)
            and isinstance(self._opt, Adam)
            and (old.beta1, old.beta2) == (self._opt.beta1, self._opt.beta2)
            and self._kopt is not None
            and kopt is not None
        ):
            # Adam's bias-correction tables depend on its betas only: a new rate (each
            # step of a schedule) keeps them, and their saturation flag.
            kopt = (*kopt[:7], self._kopt[7])
        else:
            self._bc = None
        self._kopt = kopt

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        state = sum(a.nbytes for a in self._state.values())
        return int(self._rows.nbytes + state + self._index.nbytes)

    def _note(self, keys: npt.NDArray[np.int64]) -> None:
        """List the ids of a write (a list grown too long is detached: see WriteLog)."""
        log = self._dirty
        assert log is not None
        log.append(keys.copy())
        log.n_ids += keys.shape[0]
        if len(log) > _MAX_DIRTY or log.n_ids > _MAX_DIRTY_IDS:
            self._dirty = None

    def _grow(self, n: int, need: int) -> None:
        """Make room for ``need`` rows, keeping the first ``n``: every array (rows, each
        state) gets the same capacity, or, after a MemoryError, keeps the one it had."""
        had = self._rows.shape[0]
        if need <= had:
            return
        cap = had
        while cap < need:
            cap = int(cap * _GROWTH) + 1
        if self.spec.max_rows:  # no room beyond the cap, but for one push's new rows
            cap = max(need, min(cap, self.spec.max_rows))
        try:
            self._resize(cap, n)
        except MemoryError:
            self._resize(had, n)  # those grown already shrink back (in place: no memory)
            raise

    def _resize(self, cap: int, n: int) -> None:
        # In place where it can be (see zps.store.mapped): no row copied, no page touched.
        if self._rows.shape[0] != cap:
            mapped.grow(vars(self), "_rows", cap, n)
        for k in list(self._state):  # no reference of our own: it would pin the array
            if self._state[k].shape[0] != cap:
                mapped.grow(self._state, k, cap, n)

    def _positions(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Row positions of ``ids``, creating (and initialising) absent rows."""
        before = len(self._index)
        # Room first (for every id, new or not: room not written costs no memory), so a
        # MemoryError leaves the index without ids the rows do not have.
        self._grow(before, before + ids.shape[0])
        pos, n_new = self._index.get_or_insert(ids)
        if n_new:
            after = before + n_new
            new_ids = self._index.ids(before)
            s = self.spec
            self._rows[before:after] = generate(s.init, s.seed, new_ids, s.dim, self.dtype)
            for k, arr in s.optimizer.init_state(n_new, s.dim, self.dtype).items():
                self._state[k][before:after] = arr
            if self._life:  # never pushed, never seen
                self._state[TOUCHED][before:after] = 0
                self._state[SEEN][before:after] = 0
        return pos

    def pull(self, ids: npt.ArrayLike) -> Array:
        """A fresh ``(len(ids), dim)`` array, one row per id (duplicates allowed).

        Absent ids get their initial values without being stored: reads never
        change the table (so a primary and its replicas stay identical at the
        same LSN, and evaluating on unseen ids costs no memory).
        """
        keys = as_ids(ids)
        self._index.settle()
        if KERNEL:
            return self._pull_kernel(keys)
        pos = self._lookup(keys)
        missing = pos < 0
        out = take_rows(self._rows, np.maximum(pos, 0))  # absent ones are filled below
        if missing.any():
            s = self.spec
            out[missing] = generate(s.init, s.seed, keys[missing], s.dim, self.dtype)
        return out

    def push(self, ids: npt.ArrayLike, grads: npt.ArrayLike, *, finite: bool = False) -> None:
        """Apply the optimizer to the rows of ``ids``, summing duplicate ids' gradients
        (``finite``: as :meth:`DenseTensor.push`)."""
        keys = as_ids(ids)
        g = _float_grads(self.spec.name, grads, (keys.shape[0], self.spec.dim), self.dtype, finite)
        if keys.size == 0:
            return
        if self._dirty is not None:
            self._note(keys)
        if KERNEL and self._kopt is not None:
            self._push_kernel(keys, g)
            return
        pos = self._lookup(keys)
        if bool((pos >= 0).all()) and self._distinct(pos):
            summed = g  # the common case: existing rows, each once
        else:
            pos, summed = self._summed(keys, g)
        if self._life:
            pos, summed = self._admit(pos, summed)
        self._apply_numpy(pos, summed)
        if self._life:
            self._evict()

    def _summed(self, keys: npt.NDArray[np.int64], g: Array) -> tuple[npt.NDArray[np.int64], Array]:
        """Distinct positions (rows made for absent ids) and the gradients summed per id."""
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        uniq = sorted_keys[starts]
        summed = g[order] if uniq.size == keys.size else np.add.reduceat(g[order], starts, axis=0)
        return self._positions(uniq), summed

    def _apply_numpy(self, pos: npt.NDArray[np.int64], summed: Array) -> None:
        """The optimizer on the rows at ``pos`` (distinct): gather, update, scatter."""
        state = {k: take_rows(self._state[k], pos) for k in self._opt_keys}
        param = take_rows(self._rows, pos)
        self._opt.apply(param, summed, state)
        put_rows(self._rows, pos, param)
        for k, a in state.items():
            put_rows(self._state[k], pos, a)

    # -- the compiled kernel (zps/store/_kernel.c) --------------------------------
    #
    # The same steps as the numpy version above, with the same results: the probe,
    # the duplicate check and the optimizer's update of each row in place are one
    # call for a push of distinct existing rows (a training step's push, and every
    # replica's re-run of it); a push naming absent or repeated ids takes the numpy
    # path to its distinct positions and summed gradients, then the same update.

    def _pull_kernel(self, keys: npt.NDArray[np.int64]) -> Array:
        n = keys.shape[0]
        out: Array = np.empty((n, self.spec.dim), dtype=self.dtype)
        pos = self._recent.get(keys)
        if pos is not None:
            _kernel.gather(self._rows, pos, out)
            return out
        keys = np.ascontiguousarray(keys)
        pos = np.empty(n, dtype=np.int64)
        if _kernel.pull(self._index._slots, keys, self._rows, out, pos):
            missing = pos < 0
            s = self.spec
            out[missing] = generate(s.init, s.seed, keys[missing], s.dim, self.dtype)
        else:  # remembered, as :meth:`_lookup` does
            pos.flags.writeable = False
            self._recent.put(keys, pos)
        return out

    def _push_kernel(self, keys: npt.NDArray[np.int64], g: Array) -> None:
        g = np.ascontiguousarray(g)
        pos = self._recent.get(keys)
        probe = pos is None
        if pos is None:
            keys = np.ascontiguousarray(keys)
            pos = np.empty(keys.shape[0], dtype=np.int64)
        status = self._kernel_call(keys, pos, probe, True, g, apply=not self._life)
        if status == _kernel.OK and not self._life:
            return  # the common case: existing rows, each once, updated
        summed = g
        if status in (_kernel.MISSING, _kernel.DUPLICATE):
            pos, summed = self._summed(keys, g)
        if self._life:
            pos, summed = self._admit(pos, summed)
        if self._kernel_call(None, pos, False, False, summed, apply=True) != _kernel.OK:
            self._apply_numpy(pos, summed)  # Adam steps the kernel leaves to numpy
        if self._life:
            self._evict()

    def _kernel_call(
        self,
        keys: npt.NDArray[np.int64] | None,
        pos: npt.NDArray[np.int64],
        probe: bool,
        check: bool,
        g: Array,
        *,
        apply: bool,
    ) -> int:
        """One ``_kernel.push``: probe (or take ``pos``), check for repeats (if
        ``check``) and, if ``apply``, update.  A status other than OK changed nothing."""
        marks, gen = self._next_marks() if check else (None, 0)
        states = tuple(self._state[k] for k in self._opt_keys)
        opt = self._opt
        if self._bc is None and isinstance(opt, Adam):
            self._adam(opt, _ADAM_STEPS)
        while True:
            bc = self._bc or (None, None)
            status = int(
                _kernel.push(
                    self._kopt,
                    self._index._slots if probe else None,
                    keys,
                    pos,
                    probe,
                    marks,
                    gen,
                    g,
                    self._rows,
                    states,
                    bc[0],
                    bc[1],
                    apply,
                )
            )
            if status <= 0:
                return status
            # Adam: the tables of bias corrections must reach ``status`` steps; the
            # positions are now known and distinct.
            assert isinstance(opt, Adam) and self._bc is not None
            self._adam(opt, max(status, 2 * self._bc[0].shape[0]))
            probe, marks, gen = False, None, 0

    def _adam(self, opt: Adam, steps: int) -> None:
        """Adam's tables of bias corrections for the kernel, and its saturation flag."""
        bc1, bc2, saturated = _adam_tables(opt, steps, self.dtype)
        self._bc = (bc1, bc2)
        assert self._kopt is not None
        self._kopt = (*self._kopt[:7], int(saturated))

    def _next_marks(self) -> tuple[npt.NDArray[np.uint32], int]:
        """The duplicate-check marks and a generation no row is marked with yet."""
        if self._marks.shape[0] < self._rows.shape[0]:
            # all zero: older than any generation (they start at 1)
            self._marks = np.zeros(self._rows.shape[0], dtype=np.uint32)
        self._gen += 1
        if self._gen > 0xFFFFFFFF:
            self._marks[:] = 0
            self._gen = 1
        return self._marks, self._gen

    # -- lifecycle: admission and eviction --------------------------------------
    #
    # Every decision is a function of the table's contents and the order of its pushes,
    # so a replica re-running the same pushes, or a restart replaying the log, evicts
    # exactly the same rows: eviction is part of the (replicated, logged) push.
    #
    # - The clock is the number of pushes to the table on this partition (``_tick``;
    #   after a load, the newest ``TOUCHED``, which is the same number).
    # - ``TOUCHED`` is the tick of a row's last push, ``SEEN`` how many pushes named it
    #   (up to ``admit_count``).  A row is admitted once SEEN reaches ``admit_count``:
    #   from that push on the optimizer updates it; before, the push is only counted, and
    #   the row keeps its initial values, which pulls return.  A candidate holds a row
    #   slot (and counts against ``max_rows``) until it is admitted or evicted.  With
    #   ``admit_probability`` instead, SEEN is 1 once admitted: each push of a candidate
    #   admits it if a hash of (id, tick) falls below the probability.
    # - ``ttl_steps``: every ``ttl_steps // 8`` ticks (at least 1) rows whose last push is
    #   more than ``ttl_steps`` ticks old are evicted.
    # - ``max_rows``: a push that leaves more rows evicts the least recently pushed
    #   (ties by id) down to ``max_rows - max_rows // 16``, so the table is compacted (an
    #   O(rows) rebuild of the arrays and the index) once per ``max_rows / 16`` new rows.

    def _meta(self, key: str) -> npt.NDArray[np.signedinteger[Any]]:
        """A bookkeeping column as integers (its bits, in the table's dtype's width)."""
        out: npt.NDArray[np.signedinteger[Any]] = self._state[key].view(self._int).reshape(-1)
        return out

    def _admit(
        self, pos: npt.NDArray[np.int64], summed: Array
    ) -> tuple[npt.NDArray[np.int64], Array]:
        self._tick += 1
        self._meta(TOUCHED)[pos] = self._tick
        need, chance = self.spec.admit_count, self.spec.admit_probability
        if need > 1:
            seen = self._meta(SEEN)
            counts = np.minimum(seen[pos] + 1, need)
            seen[pos] = counts
            admitted = counts >= need
            if not admitted.all():
                return pos[admitted], summed[admitted]
        elif chance < 1.0:
            seen = self._meta(SEEN)
            flags = seen[pos]
            new = flags == 0
            if new.any():
                # a draw per (id, tick): the same on every copy of the partition
                h = mix64_pair(self._index._ids[pos[new]], self._tick)
                flags[new] = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53 < chance
                seen[pos] = flags
            admitted = flags > 0
            if not admitted.all():
                return pos[admitted], summed[admitted]
        return pos, summed

    def _evict(self) -> None:
        s, n = self.spec, len(self._index)
        touched = self._meta(TOUCHED)[:n]
        drop: npt.NDArray[np.bool_] | None = None
        if s.ttl_steps and self._tick % max(1, s.ttl_steps // 8) == 0:
            old = touched < self._tick - s.ttl_steps
            if old.any():
                drop = old
        if s.max_rows and n > s.max_rows:
            keep = max(1, s.max_rows - s.max_rows // 16)
            ids = self._index.ids()
            oldest = np.lexsort((ids, touched))[: n - keep]
            lru = np.zeros(n, dtype=bool)
            lru[oldest] = True
            drop = lru if drop is None else drop | lru
        if drop is not None:
            self._compact(np.flatnonzero(~drop))
            self.evicted += int(drop.sum())

    def _compact(self, keep: npt.NDArray[np.intp]) -> None:
        """Keep only the rows at positions ``keep``: new arrays and a new index."""
        ids = self._index.ids()[keep]
        rows = self._rows[keep]
        state = {k: a[keep] for k, a in self._state.items()}
        n = keep.shape[0]
        index = IdIndex(2 * max(n, self.spec.max_rows))
        index.insert(ids)
        self._reset(max(n, self.spec.max_rows))
        self._index = index
        self._rows[:n] = rows
        for k, a in state.items():
            self._state[k][:n] = a

    def n_admitted(self) -> int:
        """Rows admitted (all rows, without admission): what an export holds."""
        admitted = self._admitted()
        return len(self._index) if admitted is None else int(admitted.sum())

    def _admitted(self) -> npt.NDArray[np.bool_] | None:
        """Which stored rows are admitted (None: all of them)."""
        if self.spec.admit_count > 1:
            return self._meta(SEEN)[: len(self._index)] >= self.spec.admit_count
        if self.spec.admit_probability < 1.0:
            return self._meta(SEEN)[: len(self._index)] > 0
        return None

    def _lookup(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``self._index.lookup(keys)``, remembering the last few complete answers.

        Training pulls a batch's rows and then pushes gradients for the same ids:
        the push finds its positions by comparing arrays (microseconds) instead of
        probing the index again.  Positions never change once assigned (rows are
        only appended; a load starts a new table state and forgets them), so a
        remembered answer in which every id was present stays right.
        """
        pos = self._recent.get(keys)
        if pos is not None:
            return pos
        pos = self._index.lookup(keys)
        if bool((pos >= 0).all()):
            pos.flags.writeable = False
            self._recent.put(keys, pos)
        return pos

    def _distinct(self, pos: npt.NDArray[np.int64]) -> bool:
        """Whether ``pos`` (valid positions) has no repeats: each stamps its index
        into a scratch array and reads it back; a repeat overwrote one."""
        if self._stamp.shape[0] < self._rows.shape[0]:
            self._stamp = np.zeros(self._rows.shape[0], dtype=np.int32)
        mark = np.arange(pos.shape[0], dtype=np.int32)
        np.put(self._stamp, pos, mark)
        return bool((self._stamp.take(pos) == mark).all())

    def set_rows(
        self,
        ids: npt.ArrayLike,
        values: npt.ArrayLike,
        state: Mapping[str, npt.ArrayLike] | None = None,
    ) -> None:
        """Set the rows of ``ids`` (distinct) to ``values`` and their optimizer state to
        ``state`` (every state column of the optimizer, row for row: an export's), or,
        without it, to the optimizer's initial state (as for a new row); other rows are
        untouched.

        Absent ids get rows.  All or nothing: bad input changes nothing.
        """
        keys = as_ids(ids)
        name = self.spec.name
        v = np.asarray(values)
        if v.shape != (keys.shape[0], self.spec.dim):
            raise ShapeMismatchError(
                f"table {name!r}: set_rows got values of shape {v.shape} for "
                f"{keys.shape[0]} ids of dim {self.spec.dim}"
            )
        if v.size and v.dtype.kind not in "fiu":
            raise BadRequestError(f"table {name!r}: values must be numeric, got {v.dtype}")
        v = v.astype(self.dtype, copy=False)
        if v.size and not bool(np.isfinite(v).all()):
            raise BadRequestError(f"table {name!r}: values contain NaN or infinity")
        widths = self.spec.optimizer.state_widths(self.spec.dim)
        given = (
            None if state is None else _given_state(name, state, widths, keys.shape[0], self.dtype)
        )
        if keys.size == 0:
            return
        uniq, counts = np.unique(keys, return_counts=True)
        if uniq.shape[0] != keys.shape[0]:
            dup = int(uniq[np.argmax(counts > 1)])
            raise BadRequestError(f"table {name!r}: set_rows names id {dup} more than once")
        if self._dirty is not None:
            self._note(keys)
        pos = self._positions(keys)
        put_rows(self._rows, pos, np.ascontiguousarray(v))
        fresh = given
        if fresh is None:
            fresh = self.spec.optimizer.init_state(keys.shape[0], self.spec.dim, self.dtype)
        for k, a in fresh.items():
            put_rows(self._state[k], pos, np.ascontiguousarray(a))
        if self._life:  # a row set is admitted, and as recent as the last push
            self._meta(TOUCHED)[pos] = self._tick
            self._meta(SEEN)[pos] = max(1, self.spec.admit_count)
            self._evict()  # within the cap again (ties by id: some set rows may go)

    def ids_after(self, after: int | None, limit: int) -> npt.NDArray[np.int64]:
        """Up to ``limit`` ids of this table greater than ``after`` (None: from the
        smallest), ascending: a page of :meth:`Client.table_ids`."""
        ids = self._index.ids()
        admitted = self._admitted()
        if admitted is not None:
            ids = ids[admitted]
        if after is not None:
            ids = ids[ids > after]
        if ids.shape[0] > limit:
            ids = np.partition(ids, limit - 1)[:limit]
        return np.sort(ids)

    def copy_values(self) -> tuple[npt.NDArray[np.int64], Array]:
        """Copies of the ids and their rows, in storage order (no optimizer state)."""
        n = len(self._index)
        admitted = self._admitted()
        if admitted is not None:
            return self._index.ids()[admitted], self._rows[:n][admitted]
        return self._index.ids(), self._rows[:n].copy()

    def copy_state(self) -> dict[str, Array]:
        """Copies of the optimizer state columns, row for row as :meth:`copy_values`."""
        n = len(self._index)
        admitted = self._admitted()
        if admitted is not None:
            return {k: self._state[k][:n][admitted] for k in self._opt_keys}
        return {k: self._state[k][:n].copy() for k in self._opt_keys}

    def export(self) -> dict[str, Array]:
        """Rows and state in ascending id order: ``ids``, ``rows``, then each state array."""
        n = len(self._index)
        ids = self._index.ids()
        order = np.argsort(ids)
        out: dict[str, Array] = {"ids": ids[order], "rows": self._rows[:n][order]}
        for k in self._widths:
            out[k] = self._state[k][:n][order]
        return out

    def load(self, data: dict[str, Array]) -> None:
        """Replace the contents with an :meth:`export` (validated; all or nothing)."""
        name = self.spec.name
        expected = {"ids", "rows", *self._widths}
        if set(data) != expected:
            raise BadRequestError(
                f"table {name!r}: export keys {sorted(data)} != {sorted(expected)}"
            )
        ids = np.asarray(data["ids"])
        if ids.ndim != 1 or ids.dtype != np.int64:
            raise BadRequestError(f"table {name!r}: export 'ids' must be 1-D int64")
        # A view of a snapshot's frames may sit at any offset: the index's kernel reads
        # aligned int64 (a copy of the ids only, where needed).
        ids = np.require(ids, requirements=["A", "C"])
        n = ids.shape[0]
        index = IdIndex(2 * n)
        # Ids that ascend are distinct (one pass); others, in storage order as snapshots
        # and checkpoints carry them, are distinct when the index takes each as new:
        # no sort (a sort of 4 M ids took seconds on a loaded machine).
        if bool(np.all(ids[1:] > ids[:-1])):
            index.insert(ids)
        elif index.get_or_insert(ids)[1] != n:
            raise BadRequestError(f"table {name!r}: export 'ids' has duplicates")
        # Validated, not copied: they are copied into the table's own arrays below.
        rows = _load_array(name, data, "rows", (n, self.spec.dim), self.dtype, copy=False)
        state = {
            k: _load_array(name, data, k, (n, w), self.dtype, copy=False)
            for k, w in self._widths.items()
        }
        self._reset(n)
        self._index = index
        self._rows[:n] = rows
        for k, a in state.items():
            self._state[k][:n] = a
        self._tick = int(self._meta(TOUCHED)[:n].max()) if self._life and n else 0

    def checksum(self) -> str:
        return checksum_arrays(self.export())


class DenseTensor:
    """The chunks of one dense tensor held by this partition (chunk index -> values).

    ``memory`` (a shard with shared memory on): where a chunk's values may live, an
    array of the shape and dtype asked for (None: no room, the heap then), so that a
    pull's reply names them instead of copying them (see :meth:`pull`)."""

    def __init__(self, spec: DenseSpec, memory: DenseMemory | None = None) -> None:
        self.spec = spec
        self._memory = memory
        self.dtype: np.dtype[Any] = np.dtype(spec.dtype)
        # Each chunk is one optimizer row of shape (1, len): Adam then counts one
        # step per chunk update, as a dense tensor's optimizer should.
        self._values: dict[int, Array] = {}
        self._state: dict[int, dict[str, Array]] = {}
        #: The compiled kernel's view of the optimizer, for a chunk's update in one
        #: pass with no temporary array (None: numpy; Adam's steps stay with numpy).
        self._opt: Optimizer = spec.optimizer  # the one applied (see _tune)
        self._kopt: _KernelOpt | None = None
        self._kstate: tuple[str, ...] = ()
        self._tune(spec)

    def _tune(self, spec: DenseSpec) -> None:
        """Apply ``spec``'s optimizer at ``spec``'s step from now on."""
        self.spec = spec
        opt = self._opt = at_step(spec.optimizer, spec.step)
        self._kopt = (
            _kernel_opt(opt)
            if KERNEL and not isinstance(opt, Adam) and self.dtype in (np.float32, np.float64)
            else None
        )
        self._kstate = tuple(opt.state_widths(1))

    def retune(self, spec: DenseSpec, *, reset: bool = False) -> None:
        """Take ``spec``: this tensor's with another optimizer or step count.  Without
        ``reset`` the same kind of optimizer keeps every chunk's state, and another kind
        is a BadRequestError naming both; ``reset`` gives every stored chunk the new
        optimizer's initial state (the values stay)."""
        if _check_retune(self.spec, spec, reset):
            for c, values in self._values.items():
                self._state[c] = spec.optimizer.init_state(1, values.size, self.dtype)
        self._tune(spec)

    def __len__(self) -> int:
        """Number of chunks materialised here."""
        return len(self._values)

    @property
    def nbytes(self) -> int:
        state = sum(a.nbytes for st in self._state.values() for a in st.values())
        return int(sum(v.nbytes for v in self._values.values()) + state)

    def chunks(self) -> list[int]:
        return sorted(self._values)

    def use_memory(self, memory: DenseMemory | None) -> None:
        """Chunks written from now on go to ``memory`` (see :class:`DenseTensor`)."""
        self._memory = memory

    def _chunk(self, chunk: int) -> Array:
        start, stop = self.spec.chunk_range(chunk)
        values = self._values.get(chunk)
        if values is None:
            s = self.spec
            values = generate(s.init, s.seed, np.arange(start, stop), 1, self.dtype)
            values = self._values[chunk] = self._own(values)
            self._state[chunk] = s.optimizer.init_state(1, stop - start, self.dtype)
        return values

    def pull(self, chunk: int) -> Array:
        """The chunk's values, 1-D and read-only (an untouched chunk is not stored).

        A stored chunk is returned without a copy, to be sent as it is: while
        anything still holds the returned view (a reply zmq has not sent yet), a
        push writes a new array instead of changing this one (see :meth:`push`).
        """
        values = self._values.get(chunk)
        if values is not None:
            view = values.reshape(-1)
            view.flags.writeable = False
            return view
        start, stop = self.spec.chunk_range(chunk)
        return generate(
            self.spec.init, self.spec.seed, np.arange(start, stop), 1, self.dtype
        ).ravel()

    def push(self, chunk: int, grad: npt.ArrayLike, *, finite: bool = False) -> None:
        """Apply ``grad`` to chunk ``chunk`` (``finite``: the caller knows its values are
        finite, a replica applying what its primary checked; the check is skipped)."""
        start, stop = self.spec.chunk_range(chunk)
        g = np.asarray(grad)
        if g.ndim != 1 or g.shape[0] != stop - start:
            raise ShapeMismatchError(
                f"dense tensor {self.spec.name!r} chunk {chunk}: expected a 1-D gradient of "
                f"{stop - start} elements, got shape {g.shape}"
            )
        g = _float_grads(self.spec.name, g, (stop - start,), self.dtype, finite)
        values = self._chunk(chunk)
        # Held here, by the dict and by getrefcount's argument: nothing else. More
        # means a view from pull() is still out (a reply lending it, or a zero-copy
        # send), so the update goes to a new array, and the view keeps the values it
        # was taken with.
        lent = sys.getrefcount(values) > _UNSHARED
        state = self._state[chunk]
        if self._kopt is not None:
            # The whole chunk as one row of the kernel's table (bit for bit numpy's),
            # written from the lent values to the new array in the same pass.
            states = tuple(state[k] for k in self._kstate)
            g = np.ascontiguousarray(g).reshape(1, -1)
            into = self._own(values, copy=True, fill=False) if lent else values
            status = _kernel.push(self._kopt, None, None, _ROW0, False, None, 0, g, into,
                                  states, None, None, True, values if lent else None)  # fmt: skip
            if status != _kernel.OK:  # never for a dense chunk's optimizers; not installed
                raise RuntimeError(f"the kernel declined a dense update (status {status})")
            self._values[chunk] = into
        else:
            if lent:
                values = self._values[chunk] = self._own(values, copy=True)
            self._opt.apply(values, g.reshape(1, -1), state)

    def copy_values(self) -> dict[int, Array]:
        """A copy of every stored chunk's values (1-D), by chunk index."""
        return {c: v.reshape(-1).copy() for c, v in self._values.items()}

    def copy_state(self) -> dict[int, dict[str, Array]]:
        """A copy of every stored chunk's optimizer state (each column 1-D), by chunk."""
        return {
            c: {k: a.reshape(-1).copy() for k, a in st.items()} for c, st in self._state.items()
        }

    def set_chunk(
        self, chunk: int, values: npt.ArrayLike, state: Mapping[str, npt.ArrayLike] | None = None
    ) -> None:
        """Set chunk ``chunk`` to ``values`` (1-D, the chunk's length) and its optimizer
        state to ``state`` (every state column, 1-D: an export's), or, without it, to the
        optimizer's initial state."""
        start, stop = self.spec.chunk_range(chunk)
        name = self.spec.name
        v = np.asarray(values)
        if v.shape != (stop - start,):
            raise ShapeMismatchError(
                f"dense tensor {name!r} chunk {chunk}: expected {stop - start} values, "
                f"got shape {v.shape}"
            )
        if v.size and v.dtype.kind not in "fiu":
            raise BadRequestError(f"dense tensor {name!r}: values must be numeric, got {v.dtype}")
        if v.size and not bool(np.isfinite(v).all()):
            raise BadRequestError(f"dense tensor {name!r}: values contain NaN or infinity")
        opt = self.spec.optimizer
        given = None
        if state is not None:
            rows = {k: np.asarray(a).reshape(1, -1) for k, a in state.items()}
            given = _given_state(name, rows, opt.state_widths(stop - start), 1, self.dtype)
        # A new array, owning its memory: a view of the old one lent to a reply keeps its
        # values, and a view of this one counts as a reference to it (see push).
        self._values[chunk] = self._own(v, copy=True)
        self._state[chunk] = opt.init_state(1, stop - start, self.dtype) if given is None else given

    def load_chunk(self, chunk: int, values: Array, state: dict[str, Any]) -> None:
        """Set chunk ``chunk`` to ``values`` with its optimizer ``state`` (a slot move)."""
        start, stop = self.spec.chunk_range(chunk)
        if values.size != stop - start:
            raise BadRequestError(
                f"dense chunk {chunk} of {self.spec.name!r}: {values.size} values"
            )
        self._values[chunk] = self._own(values, copy=True)
        self._state[chunk] = {k: np.array(a, dtype=self.dtype) for k, a in state.items()}

    def export(self) -> dict[str, Array]:
        """``chunks`` (ascending), ``values`` and each state, concatenated in chunk order."""
        idx = self.chunks()
        out: dict[str, Array] = {"chunks": np.asarray(idx, dtype=np.int64)}
        out["values"] = _concat([self._values[i] for i in idx], self.dtype)
        for k in self.spec.optimizer.state_widths(1):
            out[k] = _concat([self._state[i][k] for i in idx], self.dtype)
        return out

    def load(self, data: dict[str, Array]) -> None:
        """Replace the contents with an :meth:`export` (validated; all or nothing)."""
        name = self.spec.name
        opt = self.spec.optimizer
        expected = {"chunks", "values", *opt.state_widths(1)}
        if set(data) != expected:
            raise BadRequestError(
                f"table {name!r}: export keys {sorted(data)} != {sorted(expected)}"
            )
        chunks = np.asarray(data["chunks"])
        if chunks.ndim != 1 or chunks.dtype != np.int64:
            raise BadRequestError(f"table {name!r}: export 'chunks' must be 1-D int64")
        idx = [int(c) for c in chunks]  # one entry per chunk, not per element
        if idx != sorted(set(idx)):
            raise BadRequestError(f"table {name!r}: export 'chunks' must be strictly ascending")
        ranges = [self.spec.chunk_range(i) for i in idx]
        lengths = [stop - start for start, stop in ranges]
        bounds = np.cumsum([0, *lengths])
        values = _load_array(name, data, "values", (int(bounds[-1]),), self.dtype)
        new_values = {c: self._own(values[bounds[j] : bounds[j + 1]]) for j, c in enumerate(idx)}
        new_state: dict[int, dict[str, Array]] = {c: {} for c in idx}
        for k in opt.state_widths(1):
            widths = [opt.state_widths(n)[k] for n in lengths]
            sb = np.cumsum([0, *widths])
            arr = _load_array(name, data, k, (int(sb[-1]),), self.dtype)
            for j, c in enumerate(idx):
                new_state[c][k] = arr[sb[j] : sb[j + 1]].reshape(1, -1)
        self._values, self._state = new_values, new_state

    def checksum(self) -> str:
        return checksum_arrays(self.export())

    def _own(self, values: Array, *, copy: bool = False, fill: bool = True) -> Array:
        """``values`` as a chunk to store: shape (1, n), in the table's dtype, owning its
        memory (views of it then count as references to it: see :meth:`push`), in
        ``memory`` when it has room.  ``copy``: never ``values`` itself; without
        ``fill``, a new array of that shape, its values not yet written."""
        row = values.reshape(1, -1)
        if self._memory is not None and row.nbytes:
            out = self._memory(row.shape, self.dtype)
            if out is not None:
                if fill:
                    out[...] = row
                return out
        if not fill:
            return np.empty(row.shape, self.dtype)
        if copy or row.dtype != self.dtype:
            return np.array(row, dtype=self.dtype)
        return _owner(row)


#: Where a dense chunk's values may live: an array of this shape and dtype, whose
#: views count as references to it (its base is not an array), or None.
DenseMemory = Callable[[tuple[int, ...], np.dtype[Any]], Array | None]


def _given_state(
    name: str,
    state: Mapping[str, npt.ArrayLike],
    widths: dict[str, int],
    n: int,
    dtype: np.dtype[Any],
) -> dict[str, Array]:
    """``state`` checked against the optimizer's columns (``widths``) for ``n`` rows:
    every column, no other, each ``(n, width)``, numeric and finite; copies in ``dtype``."""
    if set(state) != set(widths):
        raise BadRequestError(
            f"table {name!r}: optimizer state {sorted(state)} given; its optimizer keeps "
            f"{sorted(widths)}"
        )
    out: dict[str, Array] = {}
    for k, w in widths.items():
        a = np.asarray(state[k])
        if a.shape != (n, w):
            raise ShapeMismatchError(
                f"table {name!r}: optimizer state {k!r} of shape {a.shape}, expected {(n, w)}"
            )
        if a.size and a.dtype.kind not in "fiu":
            raise BadRequestError(f"table {name!r}: optimizer state {k!r} must be numeric")
        a = np.array(a, dtype=dtype)
        if a.size and not bool(np.isfinite(a).all()):
            raise BadRequestError(f"table {name!r}: optimizer state {k!r} has NaN or infinity")
        out[k] = a
    return out


def _owner(a: Array) -> Array:
    """``a`` as an array owning its memory: views of a stored chunk then count as
    references to it (DenseTensor.push relies on that)."""
    return a if a.base is None else a.copy()


def _concat(parts: list[Array], dtype: np.dtype[Any]) -> Array:
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate([p.ravel() for p in parts])
