"""An embedding table: id -> row of ``spec.dim`` values plus optimizer state.

Invariants:

- A row never touched has no storage; on first touch it is filled by
  :func:`zps.init.generate` from ``(spec.seed, id)``, so every replica and every restart
  materialises identical values.
- Optimizer state sits beside the values, row for row, in the table's dtype, and a push
  updates only the rows it names: sparse updates are lazy.
- ``export()`` is canonical: ids in ascending order, so two tables with the same
  contents export, and checksum, identically whatever order the rows were created in.
  ``load(export())`` restores the table exactly.

Pushes take ``(ids, grads)`` as received; duplicates are summed before the optimizer
runs, so an id appearing twice in one push is updated once.  Where the compiled kernel
is on (:data:`zps.store.kernel.KERNEL`), pull and push run in it, with bit for bit the
numpy version's results.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64_pair
from zps.core.memo import IdsMemo
from zps.core.rows import put_rows, take_rows
from zps.errors import BadRequestError, ShapeMismatchError
from zps.init import generate
from zps.optim import Adam, Optimizer, at_step
from zps.protocol.specs import EmbeddingSpec
from zps.store import kernel, mapped
from zps.store.common import (
    Array,
    check_retune,
    checksum_arrays,
    float_grads,
    given_state,
    load_array,
)
from zps.store.index import IdIndex, IndexBuild, as_ids, index_of
from zps.store.kernel import KernelOpt, adam_tables, kernel_opt

__all__ = ["SEEN", "TOUCHED", "EmbeddingTable", "WriteLog"]

_GROWTH = 1.5
_MIN_ROWS = 64
#: Writes, and ids, a :class:`WriteLog` holds at most (then it is dropped).
_MAX_DIRTY = 1 << 16
_MAX_DIRTY_IDS = 1 << 22
#: An embedding table's bookkeeping columns when it admits or evicts rows (their names
#: cannot be an optimizer's state: those are identifiers).
TOUCHED, SEEN = "#touched", "#seen"


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
        self._kopt: KernelOpt | None = kernel_opt(self._opt)
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
        if check_retune(self.spec, spec, reset):
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
        kopt = kernel_opt(self._opt)
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
        if kernel.KERNEL:
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
        g = float_grads(self.spec.name, grads, (keys.shape[0], self.spec.dim), self.dtype, finite)
        if keys.size == 0:
            return
        if self._dirty is not None:
            self._note(keys)
        if kernel.KERNEL and self._kopt is not None:
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

    # -- the compiled kernel (zps/store/kernel.COMPILED.c) --------------------------------
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
            kernel.COMPILED.gather(self._rows, pos, out)
            return out
        keys = np.ascontiguousarray(keys)
        pos = np.empty(n, dtype=np.int64)
        if kernel.COMPILED.pull(self._index._slots, keys, self._rows, out, pos):
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
        if status == kernel.COMPILED.OK and not self._life:
            return  # the common case: existing rows, each once, updated
        summed = g
        if status in (kernel.COMPILED.MISSING, kernel.COMPILED.DUPLICATE):
            pos, summed = self._summed(keys, g)
        if self._life:
            pos, summed = self._admit(pos, summed)
        if self._kernel_call(None, pos, False, False, summed, apply=True) != kernel.COMPILED.OK:
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
        """One ``kernel.COMPILED.push``: probe (or take ``pos``), check for repeats (if
        ``check``) and, if ``apply``, update.  A status other than OK changed nothing."""
        marks, gen = self._next_marks() if check else (None, 0)
        states = tuple(self._state[k] for k in self._opt_keys)
        opt = self._opt
        if self._bc is None and isinstance(opt, Adam):
            self._adam(opt, kernel.ADAM_STEPS)
        while True:
            bc = self._bc or (None, None)
            status = int(
                kernel.COMPILED.push(
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
        bc1, bc2, saturated = adam_tables(opt, steps, self.dtype)
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

    def admitted_ids(self) -> npt.NDArray[np.int64]:
        """The ids of the admitted rows, in storage order (as :meth:`copy_values`)."""
        admitted = self._admitted()
        return self._index.ids() if admitted is None else self._index.ids()[admitted]

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
            None if state is None else given_state(name, state, widths, keys.shape[0], self.dtype)
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
        index = self._index_of(ids)
        # Validated, not copied: they are copied into the table's own arrays below.
        rows = load_array(name, data, "rows", (n, self.spec.dim), self.dtype, copy=False)
        state = {
            k: load_array(name, data, k, (n, w), self.dtype, copy=False)
            for k, w in self._widths.items()
        }
        self._reset(n)
        self._index = index
        self._rows[:n] = rows
        for k, a in state.items():
            self._state[k][:n] = a
        self._tick = int(self._meta(TOUCHED)[:n].max()) if self._life and n else 0

    def adopt(self, data: dict[str, Array], index: IndexBuild | None = None) -> None:
        """:meth:`load`, taking ``data``'s arrays as the table's own where each is a
        whole, writable array of its exact shape and dtype (from :func:`mapped.empty`,
        as a snapshot's chunks are written into: no copy, and they grow in place like
        the table's own); copied as :meth:`load` does otherwise.  All or nothing.
        ``index``: the index of ``data["ids"]`` (that very array), built while the rows
        arrived; used where the arrays are taken."""
        ids = np.asarray(data.get("ids"))
        n = ids.shape[0] if ids.ndim == 1 else -1
        widths = {"rows": self.spec.dim, **self._widths}
        arrays = {k: data.get(k) for k in widths}
        if (
            set(data) != {"ids", *widths}
            or ids.dtype != np.int64
            or not all(_ownable(a, (n, widths[k]), self.dtype) for k, a in arrays.items())
        ):
            self.load(data)  # validates, and copies
            return
        if index is not None and index.ids is ids:
            built = index.result()
            if built is None:
                raise BadRequestError(f"table {self.spec.name!r}: export 'ids' has duplicates")
        else:
            built = self._index_of(np.require(ids, requirements=["A", "C"]))
        self._reset(0)
        self._index = built
        self._rows = arrays.pop("rows")  # type: ignore[assignment]
        self._state = arrays  # type: ignore[assignment]
        self._tick = int(self._meta(TOUCHED)[:n].max()) if self._life and n else 0

    def _index_of(self, ids: npt.NDArray[np.int64]) -> IdIndex:
        """An index of ``ids`` (aligned), proving them distinct (:func:`index_of`)."""
        index = index_of(ids)
        if index is None:
            raise BadRequestError(f"table {self.spec.name!r}: export 'ids' has duplicates")
        return index

    def checksum(self) -> str:
        return checksum_arrays(self.export())


def _ownable(a: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> bool:
    """Whether a table may take ``a`` as its array as it is (see EmbeddingTable.adopt)."""
    return (
        isinstance(a, np.ndarray)
        and a.shape == shape
        and a.dtype == dtype
        and a.flags.writeable
        and a.flags.c_contiguous
        and (a.base is None or mapped.mapping(a) is not None)
    )
