"""A dense tensor's chunks held by one partition (chunk index -> values).

Invariants:

- A chunk never touched has no storage; on first touch it is filled by
  :func:`zps.init.generate` from ``(spec.seed, flat element index)``, so every replica
  and every restart materialises identical values.
- Each chunk is one optimizer row: its state sits beside its values, in the tensor's
  dtype, and a push updates only the chunk it names.
- ``export()`` is canonical: chunks in ascending order; ``load(export())`` restores the
  tensor exactly.

Where the compiled kernel is on (:data:`zps.store.kernel.KERNEL`), a chunk's update (but
Adam's) runs in it, with bit for bit the numpy version's results.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.errors import BadRequestError, ShapeMismatchError
from zps.init import generate
from zps.optim import Adam, Optimizer, at_step
from zps.protocol.specs import DenseSpec
from zps.store import kernel
from zps.store.common import (
    Array,
    check_retune,
    checksum_arrays,
    float_grads,
    given_state,
    load_array,
)
from zps.store.kernel import ROW0, KernelOpt, kernel_opt

__all__ = ["DenseMemory", "DenseTensor"]

_UNSHARED = 3  # see DenseTensor.push


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
        self._kopt: KernelOpt | None = None
        self._kstate: tuple[str, ...] = ()
        self._tune(spec)

    def _tune(self, spec: DenseSpec) -> None:
        """Apply ``spec``'s optimizer at ``spec``'s step from now on."""
        self.spec = spec
        opt = self._opt = at_step(spec.optimizer, spec.step)
        self._kopt = (
            kernel_opt(opt)
            if kernel.KERNEL
            and not isinstance(opt, Adam)
            and self.dtype in (np.float32, np.float64)
            else None
        )
        self._kstate = tuple(opt.state_widths(1))

    def retune(self, spec: DenseSpec, *, reset: bool = False) -> None:
        """Take ``spec``: this tensor's with another optimizer or step count.  Without
        ``reset`` the same kind of optimizer keeps every chunk's state, and another kind
        is a BadRequestError naming both; ``reset`` gives every stored chunk the new
        optimizer's initial state (the values stay)."""
        if check_retune(self.spec, spec, reset):
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
        g = float_grads(self.spec.name, g, (stop - start,), self.dtype, finite)
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
            k = kernel.COMPILED
            status = k.push(self._kopt, None, None, ROW0, False, None, 0, g, into,
                            states, None, None, True, values if lent else None)  # fmt: skip
            if status != k.OK:  # never for a dense chunk's optimizers; not installed
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
            given = given_state(name, rows, opt.state_widths(stop - start), 1, self.dtype)
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
        values = load_array(name, data, "values", (int(bounds[-1]),), self.dtype)
        new_values = {c: self._own(values[bounds[j] : bounds[j + 1]]) for j, c in enumerate(idx)}
        new_state: dict[int, dict[str, Array]] = {c: {} for c in idx}
        for k in opt.state_widths(1):
            widths = [opt.state_widths(n)[k] for n in lengths]
            sb = np.cumsum([0, *widths])
            arr = load_array(name, data, k, (int(sb[-1]),), self.dtype)
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


def _owner(a: Array) -> Array:
    """``a`` as an array owning its memory: views of a stored chunk then count as
    references to it (DenseTensor.push relies on that)."""
    return a if a.base is None else a.copy()


def _concat(parts: list[Array], dtype: np.dtype[Any]) -> Array:
    if not parts:
        return np.empty(0, dtype=dtype)
    return np.concatenate([p.ravel() for p in parts])
