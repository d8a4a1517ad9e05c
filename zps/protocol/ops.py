"""The operations a REQUEST carries (``{"op": name, ...}``): one table of every name and
what it is.  Pure: no I/O.

Every rule that depends on an operation's kind reads it here, through :class:`Kind` or
the name sets derived from the table (``name in MUTATIONS`` takes a plain ``str``, the
wire's value):

- ``MUTATES``: changes state: recorded for dedup, logged, replicated, its answer held
  for the replicas (``acks="all"``).  Every other operation is answered in a request's
  first part (``er``).
- ``ROWS``: addresses embedding rows by ``ids``: split by partition, subject to the slot
  ownership rule of live resharding.
- ``CHUNKS``: addresses dense chunks (``chunk``, or a ``chunks`` list): placed by chunk,
  subject to the ownership rule.
- ``READ``: reads values of rows or chunks (a pull): a request of reads and background
  pushes is lazy, and a read whose first-part answer was missed is asked again.
- ``MERGEABLE``: several of one table in one message become one operation.
- ``PUSH``: applies a gradient through the table's optimizer.
- ``ADMIN``: changes the cluster rather than values: needs an operator key under CURVE.
- ``SLOTS``: a step of a slot move (live resharding), sent by the broker.
"""

from __future__ import annotations

import enum


class Kind(enum.Flag):
    """What an operation is (see the module notes)."""

    NONE = 0
    MUTATES = enum.auto()
    ROWS = enum.auto()
    CHUNKS = enum.auto()
    READ = enum.auto()
    MERGEABLE = enum.auto()
    PUSH = enum.auto()
    ADMIN = enum.auto()
    SLOTS = enum.auto()


_M, _R, _C, _RD, _MG, _P, _A, _S = (
    Kind.MUTATES,
    Kind.ROWS,
    Kind.CHUNKS,
    Kind.READ,
    Kind.MERGEABLE,
    Kind.PUSH,
    Kind.ADMIN,
    Kind.SLOTS,
)


class Operation(enum.StrEnum):
    """Every operation name, with its :class:`Kind` (``Operation.PUSH_ROWS.kind``).  A
    member equals (and hashes as) its wire name."""

    kind: Kind

    def __new__(cls, name: str, kind: Kind) -> Operation:
        member = str.__new__(cls, name)
        member._value_ = name
        member.kind = kind
        return member

    # tables and their values
    CREATE = "create", _M
    DROP = "drop", _M | _A
    SET_OPTIMIZER = "set_optimizer", _M
    ADVANCE_STEP = "advance_step", _M
    PULL_ROWS = "pull_rows", _R | _RD | _MG
    PUSH_ROWS = "push_rows", _M | _R | _MG | _P
    SET_ROWS = "set_rows", _M | _R
    PULL_DENSE = "pull_dense", _C | _RD
    PUSH_DENSE = "push_dense", _M | _C | _P
    SET_DENSE = "set_dense", _M | _C
    #: Sync mode: apply a step's buffered gradients.
    COMMIT = "commit", _M
    # what a partition holds
    TABLES = "tables", Kind.NONE
    DESCRIBE = "describe", Kind.NONE
    IDS = "ids", Kind.NONE
    CHECKSUM = "checksum", Kind.NONE
    #: Asks for the answers a shard holds for this client (it does nothing).
    ACKS = "acks", Kind.NONE
    # exports
    CUT = "cut", Kind.NONE
    CUT_READ = "cut_read", Kind.NONE
    CUT_DROP = "cut_drop", Kind.NONE
    CHECKPOINT = "checkpoint", _A
    # live resharding's slot moves
    SLOTS_FENCE = "slots_fence", _M | _S
    SLOTS_UNFENCE = "slots_unfence", _M | _S
    SLOTS_CUT = "slots_cut", _S
    SLOTS_CUT_READ = "slots_cut_read", _S
    SLOTS_IMPORT = "slots_import", _M | _S
    SLOTS_ACTIVATE = "slots_activate", _M | _S
    SLOTS_RELEASE = "slots_release", _M | _S
    SLOTS_DROP_IMPORT = "slots_drop_import", _M | _S
    SLOTS_COMPACT = "slots_compact", _M | _S


_BY_NAME: dict[str, Operation] = {op.value: op for op in Operation}


def lookup(name: object) -> Operation | None:
    """The operation named ``name`` (any wire value; None: no such operation)."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def kind(name: object) -> Kind:
    """The kind of the operation named ``name`` (``Kind.NONE``: none, or no such)."""
    op = lookup(name)
    return op.kind if op is not None else Kind.NONE


def names(flag: Kind) -> frozenset[str]:
    """The names of every operation with all of ``flag``."""
    return frozenset(op.value for op in Operation if flag in op.kind)


#: Operations that change state (see the module notes for each set).
MUTATIONS = names(Kind.MUTATES)
ROW_OPS = names(Kind.ROWS)
CHUNK_OPS = names(Kind.CHUNKS)
READS = names(Kind.READ)
MERGEABLE = names(Kind.MERGEABLE)
PUSHES = names(Kind.PUSH)
ADMIN_OPS = names(Kind.ADMIN)
SLOT_OPS = names(Kind.SLOTS)
#: The slot moves that change state (replicated and logged).
SLOT_MUTATIONS = SLOT_OPS & MUTATIONS
