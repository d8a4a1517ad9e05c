"""Vectorised map from int64 ids to row positions of an embedding table.

An open-addressing hash table with linear probing, held in one numpy array of
16-byte slots ``(key, position)``, so that a probe costs one cache miss, not
two (``_keys`` and ``_vals`` are strided views of its columns; :data:`EMPTY`
keys and -1 positions mark free slots).  Invariants:

- capacity is a power of two and the load factor stays <= 1/2 (<= 3/4 while
  the next table is built, below), so probe sequences stay short and every probe
  loop terminates;
- positions are dense and in insertion order: the i-th id ever inserted has
  position i, and ``_ids[i]`` is that id;
- nothing is ever deleted, so a probe may stop at the first empty slot.

A table past half full is rebuilt at twice the capacity.  A large one (of at least
:data:`BACKGROUND_SLOTS` slots, with the compiled kernel) is rebuilt by a thread,
off the caller's thread (a shard's event loop): every id placed in a new table,
its pages touched for the first time, which takes seconds at tens of millions of
ids.  The old table serves lookups and takes new ids meanwhile, up to a load of
:data:`BUILD_LOAD`, and the thread places those too, until few are left; the next
insert after the build is done (or one that would pass that load, which then waits
for it), or :meth:`IdIndex.settle` (a table's pull), places the rest and swaps the
new table in.

Work is done a whole batch at a time: a Python loop runs once per *probe
round*, never once per id.  Where the optional C kernel ``zps.store._probe`` was
built (``setup.py``), :meth:`IdIndex.lookup` probes, and :meth:`IdIndex.insert`
and rehashing place new ids, in one compiled pass per id instead, prefetching home
slots ahead; both give the same positions (the slots a colliding id lands in may
differ, which no lookup can tell).  :data:`KERNEL` says which one runs;
``IdIndex.lookup_numpy`` and ``IdIndex.place_numpy`` are always there.
"""

from __future__ import annotations

import collections.abc
import os
import threading

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64, mix64_int
from zps.errors import BadRequestError
from zps.store import mapped

try:  # the compiled lookup, built by ``pip install`` where a C compiler is found
    from zps.store import _probe  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _probe = None

__all__ = ["EMPTY", "IdIndex", "IndexBuild", "index_of"]

I64 = npt.NDArray[np.int64]

#: The key marking a free slot; it can therefore never be an id.
EMPTY = int(np.iinfo(np.int64).min)
_MIN_CAPACITY = 16
_WINDOW = 16
_SLOT = np.dtype((np.void, 16))
#: Batches of at most this many ids are probed one id at a time in Python, which
#: costs less than a round of numpy calls (figures: docs/performance.md, "Figures
#: behind the code's rules").
_FEW = 4
_M64 = (1 << 64) - 1
#: Whether the compiled lookup is in use (``ZPS_NO_KERNEL=1`` in the environment turns it off).
KERNEL = _probe is not None and os.environ.get("ZPS_NO_KERNEL", "") in ("", "0")
#: Tables of at least this many slots (16 MiB; 512k ids) are rebuilt by a thread; a
#: smaller one is rebuilt by the caller, a pause the event loop can take (figures:
#: docs/performance.md, "Figures behind the code's rules").
BACKGROUND_SLOTS = 1 << 20
#: While a thread builds the next table, the current one takes new ids up to this
#: load (at 3/4 a lookup of an absent id takes about 8 probes, not 2.5, most of them
#: in the same cache line): half again as many ids as the table held at the start.
BUILD_LOAD = (3, 4)
#: The thread stops catching up with new ids when fewer than this many are left for
#: the swap: the caller places that many itself, a short pause (figures:
#: docs/performance.md, "Figures behind the code's rules").
CATCH_UP_IDS = 1 << 14


def as_ids(ids: npt.ArrayLike, what: str = "ids") -> I64:
    """``ids`` as a 1-D int64 array, or BadRequestError."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise BadRequestError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise BadRequestError(f"{what} must be int64, got {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise BadRequestError(f"{what} must be int64, got uint64 values above 2**63-1")
        arr = arr.astype(np.int64)
    return arr


def _check_keys(keys: I64) -> None:
    if keys.size and bool((keys == EMPTY).any()):
        raise BadRequestError(f"id {EMPTY} (the empty-slot sentinel) is not a valid id")


class IdIndex:
    """id (int64) -> position (0, 1, 2, ... in insertion order)."""

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        cap = _MIN_CAPACITY
        while cap < capacity:
            cap *= 2
        self._alloc(cap)
        self._ids: I64 = np.empty(cap // 2, dtype=np.int64)
        self._n = 0
        self._build: _Build | None = None  # the next table, being built by a thread

    def _alloc(self, capacity: int) -> None:
        self._use(mapped.empty(capacity, 2, np.int64))

    def _use(self, slots: I64) -> None:
        """Make ``slots`` (``(capacity, 2)``) the table, every slot free."""
        slots[:, 0] = EMPTY
        slots[:, 1] = -1
        self._over(slots)

    def _over(self, slots: I64) -> None:
        self._slots = slots
        self._records = slots.view(_SLOT).reshape(-1)  # one record per slot
        self._keys: I64 = slots[:, 0]
        self._vals: I64 = slots[:, 1]

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return int(self._keys.shape[0])

    @property
    def nbytes(self) -> int:
        building = self._build.slots.nbytes if self._build is not None else 0
        return int(self._slots.nbytes + self._ids.nbytes + building)

    @property
    def building(self) -> bool:
        """Whether a thread is building the next table (or has, not yet swapped in)."""
        return self._build is not None

    def ids(self, start: int = 0) -> I64:
        """A copy of the ids with positions ``start, start+1, ...``, in position order."""
        return self._ids[start : self._n].copy()

    def _home(self, ids: I64) -> I64:
        h = mix64(ids)
        h &= np.uint64(self.capacity - 1)
        return h.view(np.int64)

    def lookup(self, ids: npt.ArrayLike) -> I64:
        """Position of each id, or -1 where absent."""
        keys = as_ids(ids)
        if KERNEL:  # one compiled pass, whatever the batch (figures: docs/performance.md)
            out = np.empty(keys.shape[0], dtype=np.int64)
            _probe.lookup(self._slots, np.ascontiguousarray(keys), out)
            return out
        if keys.shape[0] <= _FEW:
            return self._lookup_few(keys)
        return self.lookup_numpy(keys)

    def lookup_numpy(self, ids: npt.ArrayLike) -> I64:
        """:meth:`lookup` in numpy alone (probe rounds over the whole batch)."""
        keys = as_ids(ids)
        mask = self.capacity - 1
        slot = self._home(keys)
        # Round one probes each id's home slot, which settles most of them: one
        # gather of whole slots (``take`` of records, not fancy indexing: key and
        # position share a cache line and move as one record).
        home = self._records.take(slot).view(np.int64).reshape(-1, 2)
        found = home[:, 0]
        out = home[:, 1].copy()
        miss = found != keys
        if not miss.any():
            return out
        out[miss] = -1
        active = np.flatnonzero(miss & (found != EMPTY))
        slot, want = (slot[active] + 1) & mask, keys[active]
        # Later rounds probe a window of slots with one 2-D gather, so the few long
        # probe sequences cost a handful of numpy calls instead of one per step.
        window = np.arange(_WINDOW, dtype=np.intp)
        while active.size:
            slots = (slot[:, None] + window) & mask
            probed = self._records.take(slots).view(np.int64).reshape(-1, _WINDOW, 2)
            found2 = probed[:, :, 0]
            stop = (found2 == want[:, None]) | (found2 == EMPTY)
            col = stop.argmax(axis=1)
            rows = np.arange(active.size)
            done = stop[rows, col]
            # A stop at a free slot reads -1 there, i.e. "absent" (also for EMPTY ids).
            out[active[done]] = probed[rows[done], col[done], 1]
            more = ~done
            active, slot, want = active[more], (slot[more] + _WINDOW) & mask, want[more]
        return out

    def _lookup_few(self, keys: I64) -> I64:
        """:meth:`lookup` of a handful of ids, probing slot by slot."""
        mask = self.capacity - 1
        item = self._slots.item
        out: list[int] = []
        for key in keys.tolist():
            slot = mix64_int(key & _M64) & mask
            while True:
                found = item(slot, 0)
                if found in (key, EMPTY):  # a free slot holds position -1
                    out.append(item(slot, 1))
                    break
                slot = (slot + 1) & mask
        return np.array(out, dtype=np.int64)

    def insert(self, new_ids: npt.ArrayLike) -> I64:
        """Insert ids that are unique and absent; returns their (new, consecutive) positions."""
        keys = as_ids(new_ids, "new ids")
        _check_keys(keys)
        m = keys.shape[0]
        start = self._n
        positions = np.arange(start, start + m, dtype=np.int64)
        if m == 0:
            return positions
        need = start + m
        self._make_room(need)
        self._place(keys, start)
        self._ids[start:need] = keys
        self._n = need
        return positions

    def get_or_insert(self, ids: npt.ArrayLike) -> tuple[I64, int]:
        """Positions of ``ids``, inserting absent ones once each, in first-occurrence order."""
        keys = as_ids(ids)
        pos = self.lookup(keys)
        missing = np.flatnonzero(pos < 0)
        if missing.size == 0:
            return pos, 0
        absent = keys[missing]
        if KERNEL:  # one pass: probe, insert the first occurrence, record its id
            _check_keys(absent)
            self._make_room(self._n + absent.shape[0])
            found = np.empty(absent.shape[0], dtype=np.int64)
            added = _probe.get_or_insert(self._slots, self._ids, self._n, absent, found)
            self._n += added
            pos[missing] = found
            return pos, int(added)
        uniq, first, inverse = np.unique(absent, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        uniq_pos = np.empty(uniq.shape[0], dtype=np.int64)
        uniq_pos[order] = self.insert(uniq[order])
        pos[missing] = uniq_pos[inverse.reshape(-1)]
        return pos, int(uniq.shape[0])

    def _make_room(self, need: int) -> None:
        """Capacity for ``need`` ids in all (the load factor <= 1/2, or up to
        :data:`BUILD_LOAD` while the next table is built), and room in ``_ids``."""
        build = self._build
        if build is not None:
            num, den = BUILD_LOAD
            if build.done.is_set() or den * need > num * self.capacity:
                self._swap(build)  # waits for the thread if the build is not done
        if 2 * need > self.capacity and self._build is None:
            cap = self.capacity
            while 2 * need > cap:
                cap *= 2
            if not self._start_build(need, cap):
                self._rehash(cap)
        if need > self._ids.shape[0]:
            self._make_ids_room(max(need, self.capacity // 2))

    def settle(self) -> None:
        """Swap in the next table if its build is done (inserts do it too; a table's
        reads call this, so a build finished after the last insert does not keep the
        old table's memory)."""
        build = self._build
        if build is not None and build.done.is_set():
            self._swap(build)

    def _start_build(self, need: int, capacity: int) -> bool:
        """Have a thread build the table of ``capacity`` slots, if the current one is
        large and can hold ``need`` ids meanwhile; False: rehash now."""
        num, den = BUILD_LOAD
        if (
            not KERNEL
            or self.capacity < BACKGROUND_SLOTS
            or capacity != 2 * self.capacity
            or den * need > num * self.capacity
        ):
            return False
        # Room for the ids of the new table's half load, before the thread holds a view
        # of them (which would keep them from growing in place).
        self._make_ids_room(capacity // 2)
        try:
            slots = mapped.empty(capacity, 2, np.int64)
        except MemoryError:
            return False  # the rehash in place needs only the new half
        self._build = _Build(slots, self._ids, self._n, lambda: self._n)
        return True

    def _swap(self, build: _Build) -> None:
        """The built table, with the ids added since its build began, in use."""
        build.thread.join()
        self._build = None
        if build.error is not None:  # (MemoryError, say): rebuilt in place by the caller
            self._rehash(build.slots.shape[0])
            return
        n0 = build.placed
        if self._n > n0:
            _probe.place(build.slots, self._ids[n0 : self._n], n0)
        self._over(build.slots)

    def _make_ids_room(self, need: int) -> None:
        if need > self._ids.shape[0]:
            ids = {"ids": self._ids.reshape(-1, 1)}
            del self._ids  # the view that would keep it from growing in place
            try:
                mapped.grow(ids, "ids", need, self._n)
            finally:  # grown, or as it was (MemoryError)
                self._ids = ids["ids"].reshape(-1)

    def _rehash(self, capacity: int) -> None:
        """Every id placed again in a table of ``capacity`` slots: the old table's
        memory grown in place (zps.store.mapped) and reused, so that only the new part's
        pages are touched for the first time (half of them: a first touch is most of a
        rehash's time where pages are costly to fault in, as in a virtual machine)."""
        slots = {"slots": self._slots}
        del self._slots, self._records, self._keys, self._vals
        try:
            mapped.grow(slots, "slots", capacity, 0)
        except MemoryError:
            self._over(slots["slots"])  # the table as it was
            raise
        self._use(slots["slots"])
        self._place(self._ids[: self._n], 0)

    def _place(self, keys: I64, first: int) -> None:
        """Write absent, unique ``keys`` into free slots, with positions ``first``,
        ``first + 1``, ...  (compiled: 2,000,000 ids rehashed in a tenth of the numpy
        version's time; see docs/performance.md)."""
        if KERNEL:
            _probe.place(self._slots, np.ascontiguousarray(keys), first)
        else:
            self.place_numpy(keys, first)

    def place_numpy(self, keys: I64, first: int) -> None:
        """:meth:`_place` in numpy alone, one vectorised probe round at a time."""
        positions = np.arange(first, first + keys.shape[0], dtype=np.int64)
        mask = self.capacity - 1
        pending = np.arange(keys.shape[0], dtype=np.intp)
        slot = self._home(keys)
        while pending.size:
            free = np.flatnonzero(self._keys[slot] == EMPTY)
            won = np.zeros(pending.shape[0], dtype=bool)
            if free.size:
                # Several candidates may want the same free slot this round: the
                # first takes it and the others move on.  Free slots hold -1, so a
                # ufunc.at minimum over codes below -1 elects the first claimant
                # of each slot without sorting.
                want = slot[free]
                code = np.arange(-free.shape[0] - 2, -2, dtype=np.int64)
                np.minimum.at(self._vals, want, code)
                elected = self._vals[want] == code
                winners = pending[free[elected]]
                claimed = want[elected]
                self._keys[claimed] = keys[winners]
                self._vals[claimed] = positions[winners]
                won[free[elected]] = True
            # Every loser's slot is now taken (it was full, or a winner just took
            # it), so all of them advance.
            lost = ~won
            pending, slot = pending[lost], (slot[lost] + 1) & mask


def _fill_and_place(slots: I64, ids: I64) -> None:
    """Clear ``slots`` and place ``ids`` with positions 0, 1, ... (the build's work,
    without the GIL: numpy's fill and the kernel release it)."""
    slots[:, 0] = EMPTY
    slots[:, 1] = -1
    _probe.place(slots, ids, 0)


class _Build:
    """The next table of an :class:`IdIndex`, built by a thread: its first ``n`` ids
    placed, then those inserted since (``count()``: how many the index holds), while
    more than :data:`CATCH_UP_IDS` are left.  An id, once in ``ids`` below the count,
    is never written again, and ``ids`` is not moved while the thread views it (the
    index made room first)."""

    def __init__(
        self, slots: I64, ids: I64, n: int, count: collections.abc.Callable[[], int]
    ) -> None:
        self.slots = slots
        self.placed = int(n)  # ids [0, placed) are in slots
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(ids, count), name="zps-index-build", daemon=True
        )
        self.thread.start()

    def _run(self, ids: I64, count: collections.abc.Callable[[], int]) -> None:
        try:
            _fill_and_place(self.slots, ids[: self.placed])
            while (n := count()) - self.placed >= CATCH_UP_IDS:
                _probe.place(self.slots, ids[self.placed : n], self.placed)
                self.placed = n
        except BaseException as e:  # MemoryError, a broken table: the caller rehashes
            self.error = e
        finally:
            del ids  # its view of the ids: they may grow in place again
            self.done.set()


def index_of(ids: I64) -> IdIndex | None:
    """An index of ``ids`` (1-D int64, aligned), positions in their order, sized for them
    (load <= 1/2); None if two of them are the same.  Ids that ascend are proven
    distinct in one pass; others, in storage order as snapshots and checkpoints carry
    them, as the index takes each as new (no sort: seconds for 4 M ids)."""
    n = ids.shape[0]
    index = IdIndex(2 * n)
    if bool(np.all(ids[1:] > ids[:-1])):
        index.insert(ids)
    elif KERNEL:  # one pass, each id taken as new (the empty index looked up for none)
        _check_keys(ids)
        found = np.empty(n, dtype=np.int64)
        index._n = int(
            _probe.get_or_insert(index._slots, index._ids, 0, np.ascontiguousarray(ids), found)
        )
        if index._n != n:
            return None
    elif index.get_or_insert(ids)[1] != n:
        return None
    return index


class IndexBuild:
    """:func:`index_of` ``ids``, by a thread of its own started at once: the ids of a
    table whose rows are still arriving (a snapshot stream, a checkpoint being read)
    are indexed while the rows come.  ``ids`` must not change meanwhile; the index is
    :meth:`result`'s once the thread is done."""

    def __init__(self, ids: I64) -> None:
        self.ids = ids
        self._index: IdIndex | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zps-index-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._index = index_of(self.ids)
        except BaseException as e:  # MemoryError, a bad id: raised by result()
            self._error = e

    def result(self) -> IdIndex | None:
        """The index (None: the ids hold duplicates), once the thread is done; its error
        is raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._index
