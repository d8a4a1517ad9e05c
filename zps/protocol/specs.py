"""Table specs: what ``create_dense`` / ``create_embedding`` send and shards keep.

A spec is a frozen dataclass; two specs are the same table exactly when they
compare equal, which is what makes ``create_*`` idempotent.  Both the Python
constructor and :func:`spec_from_wire` validate every field (in
``__post_init__``) and raise :class:`~zps.errors.BadRequestError` naming the
field, so a spec object that exists is always a valid one.  Numbers are
normalised (a tuple shape, float hyperparameters) so that a spec survives the
wire round trip ``spec_from_wire(s.to_wire()) == s``.

``step`` is the table's step count (``ps.advance_step``), at which a scheduled
learning rate is evaluated: the table's progress, not its identity, so it takes no
part in equality (a ``create_*`` of a table that has trained for a while is still
idempotent), while ``to_wire`` carries it (when not 0) wherever a spec goes:
replication, snapshots, checkpoints, ``describe`` and exports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from zps.errors import BadRequestError
from zps.init import Constant, Initializer, Normal, Uniform, Zeros, init_from_spec
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum, Optimizer, optimizer_from_spec
from zps.protocol.codec import MESSAGE_BUDGET

__all__ = ["DTYPES", "DenseSpec", "EmbeddingSpec", "TableSpec", "spec_from_wire"]

#: The most steps a table counts (``ps.advance_step``): integers exact in a double.
MAX_STEP = 2**53

#: Supported value dtypes.  float16 is refused: Adam's and Adagrad's small
#: epsilons underflow and accumulators overflow in half precision.
DTYPES = ("float32", "float64")
MAX_NAME_LEN = 200
MAX_DENSE_SIZE = 2**40
MAX_DIM = 65536
MAX_SEED = 2**63
#: A dense chunk travels whole in one message (a push of it, or a pull's reply).
MAX_CHUNK_BYTES = MESSAGE_BUDGET

_INIT_TYPES = (Zeros, Constant, Uniform, Normal)
_OPT_TYPES = (SGD, Momentum, Adagrad, Adam, FTRL)


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _check_common(
    kind: str, name: object, dtype: object, init: object, opt: object, seed: object
) -> None:
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"{kind} spec: name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LEN:
        raise BadRequestError(f"{kind} spec: name is longer than {MAX_NAME_LEN} characters")
    if dtype not in DTYPES:
        raise BadRequestError(f"{kind} spec {name!r}: dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(init, _INIT_TYPES):
        raise BadRequestError(f"{kind} spec {name!r}: init must be a zps.init initializer")
    if not isinstance(opt, _OPT_TYPES):
        raise BadRequestError(f"{kind} spec {name!r}: optimizer must be a zps.optim optimizer")
    if not _is_int(seed) or not 0 <= int(seed) < MAX_SEED:  # type: ignore[call-overload]
        raise BadRequestError(f"{kind} spec {name!r}: seed must be an integer in [0, 2**63)")


def _check_step(obj: Any, kind: str) -> None:
    step = obj.step
    if not _is_int(step) or not 0 <= int(step) <= MAX_STEP:
        raise BadRequestError(
            f"{kind} spec {obj.name!r}: step must be an integer in [0, 2**53], got {step!r}"
        )
    object.__setattr__(obj, "step", int(step))


@dataclass(frozen=True)
class DenseSpec:
    """A dense tensor, stored as flat chunks of ``chunk_elems`` elements."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    init: Initializer
    optimizer: Optimizer
    seed: int
    chunk_elems: int
    #: The table's step count (see the module notes).
    step: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        _check_common("dense", self.name, self.dtype, self.init, self.optimizer, self.seed)
        _check_step(self, "dense")
        shape = self.shape
        if not isinstance(shape, tuple | list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise BadRequestError(
                f"dense spec {self.name!r}: shape must be a sequence of non-negative ints, "
                f"got {shape!r}"
            )
        shape = tuple(int(d) for d in shape)
        if math.prod(shape) > MAX_DENSE_SIZE:
            raise BadRequestError(f"dense spec {self.name!r}: shape {shape} exceeds 2**40 elements")
        if not _is_int(self.chunk_elems) or self.chunk_elems < 1:
            raise BadRequestError(f"dense spec {self.name!r}: chunk_elems must be an integer >= 1")
        if int(self.chunk_elems) * np.dtype(self.dtype).itemsize > MAX_CHUNK_BYTES:
            raise BadRequestError(
                f"dense spec {self.name!r}: chunks of {self.chunk_elems} elements exceed "
                f"{MAX_CHUNK_BYTES} bytes, the most one message carries"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "chunk_elems", int(self.chunk_elems))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def n_chunks(self) -> int:
        return -(-self.size // self.chunk_elems)

    def chunk_range(self, i: int) -> tuple[int, int]:
        """Flat element range ``[start, stop)`` of chunk ``i``."""
        if not _is_int(i) or not 0 <= i < self.n_chunks:
            raise BadRequestError(
                f"dense tensor {self.name!r}: chunk {i!r} out of range [0, {self.n_chunks})"
            )
        start = int(i) * self.chunk_elems
        return start, min(start + self.chunk_elems, self.size)

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": "dense",
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "init": self.init.spec(),
            "optimizer": self.optimizer.spec(),
            "seed": self.seed,
            "chunk_elems": self.chunk_elems,
            **({"step": self.step} if self.step else {}),
        }


#: The optional lifecycle fields of an embedding spec (0: off), sent only when set.
LIFECYCLE = ("admit_count", "ttl_steps", "max_rows")
#: ... and the optional float one (1.0: off); ``step`` (either kind) is sent when not 0.
OPTIONAL = (*LIFECYCLE, "admit_probability", "step")


@dataclass(frozen=True)
class EmbeddingSpec:
    """An embedding table: int64 id -> row of ``dim`` values, created on first touch.

    Lifecycle (0: off; see :class:`~zps.store.tables.EmbeddingTable`): ``admit_count``,
    an id's row is trained from its ``admit_count``-th push on (until then pushes are only
    counted and pulls return the initial value); ``ttl_steps``, a row not pushed in that
    many of this table's pushes on its partition is evicted; ``max_rows``, a partition
    keeps at most that many rows of the table, evicting the least recently pushed;
    ``admit_probability`` (1.0: off; not with ``admit_count``), each push of an id not yet
    admitted admits it with that probability.
    """

    name: str
    dim: int
    dtype: str
    init: Initializer
    optimizer: Optimizer
    seed: int
    admit_count: int = 0
    ttl_steps: int = 0
    max_rows: int = 0
    admit_probability: float = 1.0
    #: The table's step count (see the module notes).
    step: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        _check_common("embedding", self.name, self.dtype, self.init, self.optimizer, self.seed)
        _check_step(self, "embedding")
        if not _is_int(self.dim) or not 1 <= self.dim <= MAX_DIM:
            raise BadRequestError(
                f"embedding spec {self.name!r}: dim must be an integer in [1, {MAX_DIM}], "
                f"got {self.dim!r}"
            )
        for key in LIFECYCLE:
            value = getattr(self, key)
            if not _is_int(value) or not 0 <= value < 2**31:
                raise BadRequestError(
                    f"embedding spec {self.name!r}: {key} must be an integer in [0, 2**31), "
                    f"got {value!r}"
                )
            object.__setattr__(self, key, int(value))
        p = self.admit_probability
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise BadRequestError(
                f"embedding spec {self.name!r}: admit_probability must be a number in "
                f"(0, 1], got {p!r}"
            )
        object.__setattr__(self, "admit_probability", float(p))
        if self.admit_count > 1 and self.admit_probability < 1.0:
            raise BadRequestError(
                f"embedding spec {self.name!r}: admit_count and admit_probability exclude "
                "each other"
            )
        object.__setattr__(self, "dim", int(self.dim))
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def lifecycle(self) -> bool:
        """Whether rows are admitted or evicted (any lifecycle field set)."""
        return bool(
            self.admit_count > 1 or self.ttl_steps or self.max_rows or self.admit_probability < 1
        )

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "kind": "embedding",
            "name": self.name,
            "dim": self.dim,
            "dtype": self.dtype,
            "init": self.init.spec(),
            "optimizer": self.optimizer.spec(),
            "seed": self.seed,
        }
        wire.update({k: getattr(self, k) for k in LIFECYCLE if getattr(self, k)})
        if self.admit_probability < 1.0:
            wire["admit_probability"] = self.admit_probability
        if self.step:
            wire["step"] = self.step
        return wire


TableSpec = DenseSpec | EmbeddingSpec
_KINDS: dict[str, type[TableSpec]] = {"dense": DenseSpec, "embedding": EmbeddingSpec}


def spec_from_wire(obj: object) -> TableSpec:
    """Parse the dict produced by ``to_wire()``: every field present, nothing else."""
    if not isinstance(obj, Mapping):
        raise BadRequestError(f"table spec must be a map, got {type(obj).__name__}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise BadRequestError(f"table spec: kind must be 'dense' or 'embedding', got {kind!r}")
    cls = _KINDS[kind]
    names = [f.name for f in fields(cls)]
    for key in obj:
        if key != "kind" and key not in names:
            raise BadRequestError(f"{kind} spec: unknown field {key!r}")
    for key in names:
        if key not in obj and key not in OPTIONAL:
            raise BadRequestError(f"{kind} spec: field {key!r} is missing")
    kwargs = {key: obj[key] for key in names if key in obj}
    if kind == "dense" and not isinstance(kwargs["shape"], list | tuple):
        raise BadRequestError(f"dense spec: shape must be a list of ints, got {kwargs['shape']!r}")
    kwargs["init"] = init_from_spec(kwargs["init"])
    kwargs["optimizer"] = optimizer_from_spec(kwargs["optimizer"])
    return cls(**kwargs)
