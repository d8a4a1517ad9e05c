"""A shard's request handling, without I/O.

``ShardCore.handle(route, header, payloads)`` runs the batched operations of
one REQUEST against the partition's store and returns the reply frames.

Rules:

1. A request for another partition or epoch than the one this shard serves
   is refused whole (``NOT_PRIMARY`` / ``STALE_EPOCH``) and changes nothing.
2. Each operation gets its own status: one bad operation in a batch does not
   fail its neighbours (they may come from different callers).
3. A message is identified by ``(client_id, seq)``.  A retried message is not
   applied twice: its mutations answer with the recorded status; its reads run
   again (they are idempotent).  The record is bounded in bytes; a message
   retried after its entry was evicted is refused with ``BAD_REQUEST`` (it may
   have been applied), never applied again.
4. Anything malformed becomes an error status naming what is wrong; no input
   raises out of :meth:`ShardCore.handle`.
5. ``lsn`` counts applied mutations.  A message that advanced it is replicated
   as it arrived; a replica re-runs its mutations (:meth:`apply_replicated`) and
   must arrive at the same LSN, and so at the same state: the operations are
   deterministic.
6. Only a primary answers client requests; a replica or a spare refuses them
   with ``NOT_PRIMARY`` and changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

import zps.shard.slotops as slotops
from zps.errors import (
    BadRequestError,
    ProtocolError,
    ShapeMismatchError,
)
from zps.optim import optimizer_from_spec
from zps.protocol.codec import (
    CODEC_RAW,
    TRAFFIC,
    BufferLike,
    CompressPolicy,
    Encoder,
    MsgType,
    Route,
    array_from,
)
from zps.protocol.ops import MUTATIONS
from zps.shard.cuts import Cuts
from zps.shard.dedup import ENTRY_OVERHEAD, FLOOR_OVERHEAD, OK, DedupCache, expired_status
from zps.shard.records import MAX_MESSAGE_CHARS, Limits, ShardStats, error_status
from zps.store import PartitionStore, spec_from_wire
from zps.store.snapshot import Snapshot
from zps.store.stepbuf import Pending, StepBuffer
from zps.store.tables import DenseMemory, EmbeddingTable

__all__ = [
    "ENTRY_OVERHEAD",
    "FLOOR_OVERHEAD",
    "MAX_MESSAGE_CHARS",
    "MUTATIONS",
    "OK",
    "DedupCache",
    "Handled",
    "Limits",
    "ShardCore",
    "ShardStats",
    "error_status",
]


def _is_mutation(op: object) -> bool:
    # ``op["op"]`` may be any msgpack value, including an unhashable list or map.
    name = op.get("op") if isinstance(op, dict) else None
    return isinstance(name, str) and name in MUTATIONS


#: No payload known finite (a request's payloads read inline).
_NONE_FINITE: Mapping[int, str] = MappingProxyType({})


@dataclass(slots=True)
class Handled:
    """What :meth:`ShardCore.handle_request` did with one message (made per request: not
    frozen, which costs a call per field)."""

    #: The reply frames (with ``split``: maybe the first part, see ``writes_res``).
    reply: list[BufferLike]
    #: The message changed state: it must be replicated and logged.
    changed: bool
    #: With ``split``: the statuses for the final part (each write's, ``None`` for each
    #: read), when ``reply`` answers only the reads; else None.
    writes_res: list[dict[str, Any] | None] | None = None
    #: ``reply`` carries the ``acked`` it was given.
    carried: bool = False
    #: The message was answered from the dedup record (a re-sent one).
    duplicate: bool = False
    #: Every operation succeeded on a message run for the first time (a replica need
    #: not check its gradients again: see :meth:`ShardCore.apply_replicated`).
    clean: bool = False


class ShardCore:
    """Serves one partition; see the module rules."""

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        compress: CompressPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits or Limits()
        self.compress = compress or TRAFFIC
        self.partition: int | None = None
        self.epoch = 0
        self.primary = False
        #: Where dense values may live (set by a shard with shared memory on, before
        #: it holds a partition): a pull's reply then names them, not a copy.
        self.dense_memory: DenseMemory | None = None
        self.store = PartitionStore()
        self.dedup = self._new_dedup()
        self.steps = self._new_steps()
        self.lsn = 0
        self.stats = ShardStats()
        #: Whether every operation of the last request handled succeeded (a replica then
        #: needs not check its gradients again: see apply_replicated), and whether the
        #: message being re-run is such a one.
        self.last_clean = False
        self._checked = False
        #: Payloads of the request being handled whose floats are known finite (checked
        #: as they were read from a client's shared memory), with the dtype checked.
        self._finite: Mapping[int, str] = _NONE_FINITE
        self._clock = clock
        self._cid = b""  # the client of the message being handled
        #: Export cuts: the partition's values at one LSN, read in pieces (see op_cut).
        self.cuts = Cuts()
        #: Set by the shard process: whether it has a data dir to write checkpoints to,
        #: the newest checkpoint on disk, and an LSN an operator asked a checkpoint of.
        self.checkpoint_enabled = False
        self.checkpointed: dict[str, Any] | None = None
        self.checkpoint_wanted: int | None = None
        #: Live resharding: the slots this partition serves (None: every slot routed
        #: here; see zps/shard/slotops.py).
        self.slots: slotops.SlotState | None = None

    def assign(
        self, partition: int | None, epoch: int, *, primary: bool = True
    ) -> PartitionStore | None:
        """Hold ``partition`` at ``epoch`` (None: nothing), as primary or replica.

        Data is kept when the partition stays the same (a promotion, or a
        re-registration after a broker restart); another partition starts empty, and
        the store let go is returned (None if none): releasing the memory of a large
        one takes time in proportion to it, which a driver spends off its loop.
        """
        dropped = None
        if partition != self.partition:
            dropped = self.store
            self.cuts.clear()
            self.checkpointed = self.checkpoint_wanted = None
            self.store = PartitionStore(self.dense_memory)
            self.dedup = self._new_dedup()
            self.steps = self._new_steps()
            self.lsn = 0
            self.slots = None
        self.partition, self.epoch = partition, epoch
        self.primary = primary and partition is not None
        return dropped

    def _new_dedup(self) -> DedupCache:
        return DedupCache(self.limits.dedup_bytes)

    def _new_steps(self) -> StepBuffer:
        return StepBuffer(window=self.limits.step_window, max_bytes=self.limits.step_buffer_bytes)

    # -- replication ---------------------------------------------------------

    def snapshot(
        self, export: Callable[[PartitionStore], dict[str, Any]] | None = None
    ) -> Snapshot:
        """Everything a replica or a checkpoint needs, at the current LSN.  ``export``
        copies the tables (default: :meth:`PartitionStore.export`)."""
        if self.partition is None:
            raise BadRequestError("no partition to snapshot")
        return Snapshot(
            self.partition,
            self.epoch,
            self.lsn,
            (export or PartitionStore.export)(self.store),
            self.dedup.entries(),
            self.steps.export(),
            self.dedup.floors(),
            None if self.slots is None else self.slots.to_wire(),
        )

    def load_snapshot(self, snap: Snapshot) -> None:
        """Replace everything with ``snap`` (all or nothing: a bad one changes nothing)."""
        self.install_snapshot(snap, self.build_store(snap, self.dense_memory))

    def build_store(self, snap: Snapshot, memory: DenseMemory | None = None) -> PartitionStore:
        """The tables of ``snap``, validated, touching nothing of this core: the heavy
        part of :meth:`load_snapshot` (seconds for a large partition), which a replica
        runs off its event loop so that its heartbeats go on.  ``memory``: where dense
        values may live (None: the heap; a thread other than the loop's must not take
        regions of the arena)."""
        store = PartitionStore(memory)
        store.load(snap.export)
        return store

    def install_snapshot(self, snap: Snapshot, store: PartitionStore) -> None:
        """Replace everything with ``snap``, whose tables :meth:`build_store` made; dense
        values written from now on go to this core's ``dense_memory``."""
        steps = self._new_steps()
        steps.load(snap.steps)
        slots = None if snap.slots is None else slotops.SlotState.from_wire(snap.slots)
        store.use_memory(self.dense_memory)
        self.store, self.steps = store, steps
        self.slots = slots
        self.dedup.load(snap.dedup, snap.dedup_floors)
        self.partition, self.epoch, self.lsn = snap.partition, snap.epoch, snap.lsn

    def apply_replicated(
        self, header: dict[str, Any], payloads: Sequence[BufferLike], *, checked: bool = False
    ) -> int:
        """Re-run the mutations of a message the primary applied; returns the new LSN.
        ``checked``: every operation succeeded on the primary, so its gradients are
        finite (the primary checked them; the same bytes are not checked again)."""
        ops, key = self._parse_header(header)
        self._cid = key[0] if key else b""
        recorded: list[dict[str, Any]] = []
        scratch = Encoder()
        self._checked = checked
        try:
            for op in ops:
                if _is_mutation(op):
                    recorded.append(self._run(op, payloads, scratch))
                else:
                    recorded.append(OK)
        finally:
            self._checked = False
        if key is not None:
            self.dedup.put(key, recorded)
        return self.lsn

    # -- requests ------------------------------------------------------------

    def handle(
        self, route: Route, header: dict[str, Any], payloads: Sequence[BufferLike]
    ) -> list[BufferLike]:
        return self.handle_request(route, header, payloads).reply

    def handle_request(
        self,
        route: Route,
        header: dict[str, Any],
        payloads: Sequence[BufferLike],
        finite: Mapping[int, str] | None = None,
        *,
        split: bool = False,
        acked: list[list[Any]] | None = None,
    ) -> Handled:
        """The reply, whether the message changed state (so must be replicated), and
        the rest of :class:`Handled`.  ``finite``: payload index -> the dtype its floats
        were found finite as (a raw gradient of that dtype there is not checked again).

        ``split`` (the caller will hold the writes' answer until the replicas have
        them): a request that changed state and also reads gets the reply in two parts.
        The one returned answers the reads and leaves each write's result ``None``
        (header ``part``); ``writes_res`` holds the writes' statuses for the final
        part, ``None`` for each read.  A reply that goes at once (the first part, or one
        to a request that changed nothing) carries ``acked`` (``[req_id, statuses]`` of
        earlier requests of the same client, see zps.shard.admission.HeldAcks), and
        ``carried`` says so."""
        if finite:
            self._finite = finite
            try:
                return self._handle(route, header, payloads, split, acked)
            finally:
                self._finite = _NONE_FINITE
        return self._handle(route, header, payloads, split, acked)

    def _handle(
        self,
        route: Route,
        header: dict[str, Any],
        payloads: Sequence[BufferLike],
        split: bool,
        acked: list[list[Any]] | None,
    ) -> Handled:
        stats = self.stats
        stats.requests += 1
        stats.bytes_in += sum(map(len, payloads))
        self.last_clean = False
        errors = stats.errors
        reply_route = Route(MsgType.REPLY, route.partition, self.epoch, route.req_id)
        enc = Encoder(self.compress)
        refusal = self._refusal(route)
        if refusal is not None:
            self.stats.errors += 1
            return Handled(enc.build(reply_route, refusal), False)
        try:
            ops, key = self._parse_header(header)
        except ProtocolError as e:
            self.stats.malformed += 1
            return Handled(enc.build(reply_route, {"st": "BAD_REQUEST", "msg": str(e)}), False)
        lsn_before = self.lsn
        self._cid = key[0] if key else b""
        cached = self.dedup.get(key) if key is not None else None
        duplicate = cached is not None
        if duplicate:
            self.stats.duplicates += 1
        elif (
            key is not None
            and (floor := self.dedup.expired(key)) is not None
            and any(_is_mutation(op) for op in ops)
        ):
            self.stats.expired += 1
            cached = [expired_status(key, floor)] * len(ops)
        if cached is None and self.slots is not None:
            # Slot ownership (live resharding), after the dedup lookup: a re-sent
            # message applied before a fence is answered from its record above.
            moved = slotops.check(self, ops, payloads)
            if moved is not None:
                return Handled(enc.build(reply_route, moved), False)
        results: list[dict[str, Any]] = []
        recorded: list[dict[str, Any]] = []
        any_mutation = False
        for i, op in enumerate(ops):
            is_mutation = _is_mutation(op)
            any_mutation = any_mutation or is_mutation
            if cached is not None and is_mutation:
                results.append(cached[i] if i < len(cached) else OK)
                recorded.append(results[-1])
                continue
            results.append(self._run(op, payloads, enc))
            recorded.append(results[-1] if is_mutation else OK)
        if key is not None and cached is None and any_mutation:
            self.dedup.put(key, recorded)
        clean = self.last_clean = cached is None and self.stats.errors == errors
        changed = self.lsn != lsn_before
        if split and changed and len(ops) > 1:
            reads = [None if _is_mutation(op) else r for op, r in zip(ops, results, strict=True)]
            if any(r is not None for r in reads):
                # A read's place in the final part stays None: a client that missed the
                # first part asks again rather than take a status for its rows.
                writes_res = [
                    rec if _is_mutation(op) else None for op, rec in zip(ops, recorded, strict=True)
                ]
                early: dict[str, Any] = {"st": "OK", "res": reads, "part": 1}
                if acked:
                    early["acked"] = acked
                return Handled(
                    enc.build(reply_route, early), True, writes_res, bool(acked), duplicate, clean
                )
        whole: dict[str, Any] = {"st": "OK", "res": results}
        carried = bool(acked) and not changed
        if carried:  # answered now (a write's reply may wait, or be refused)
            whole["acked"] = acked
        return Handled(enc.build(reply_route, whole), changed, None, carried, duplicate, clean)

    def _refusal(self, route: Route) -> dict[str, Any] | None:
        if self.partition is None or route.partition != self.partition or not self.primary:
            return {
                "st": "NOT_PRIMARY",
                "msg": f"this shard does not serve partition {route.partition}",
            }
        if route.epoch != self.epoch:
            return {
                "st": "STALE_EPOCH",
                "msg": f"request for epoch {route.epoch}; partition {self.partition} "
                f"is at epoch {self.epoch}",
            }
        return None

    def _parse_header(self, header: dict[str, Any]) -> tuple[list[Any], tuple[bytes, int] | None]:
        ops = header.get("ops")
        if not isinstance(ops, list) or not ops:
            raise ProtocolError("request header needs a non-empty list 'ops'")
        if len(ops) > self.limits.max_ops:
            raise ProtocolError(
                f"{len(ops)} operations in one request exceed the limit of {self.limits.max_ops}"
            )
        cid, seq = header.get("cid"), header.get("seq")
        if cid is None and seq is None:
            return ops, None
        if not isinstance(cid, bytes) or not 0 < len(cid) <= 64 or type(seq) is not int:
            raise ProtocolError("'cid' must be 1-64 bytes and 'seq' an integer")
        return ops, (cid, seq)

    def _run(self, op: object, payloads: Sequence[BufferLike], enc: Encoder) -> dict[str, Any]:
        self.stats.ops += 1
        try:
            if not isinstance(op, dict):
                raise BadRequestError(f"operation must be a map, got {type(op).__name__}")
            name = op.get("op")
            if not isinstance(name, str):
                raise BadRequestError("operation lacks a string 'op'")
            handler = _HANDLERS.get(name)
            if handler is None:
                raise BadRequestError(f"unknown operation {name!r}"[:120])
            self.stats.by_op[name] += 1  # known names only: a peer can't grow this map
            result = handler(self, op, payloads, enc)
            if name in MUTATIONS and result.get("created", result.get("changed", True)):
                self.lsn += 1  # an idempotent create that changed nothing is no mutation
            return result
        except Exception as e:  # rule 4: every failure becomes a status
            self.stats.errors += 1
            return error_status(e)

    # -- operations ----------------------------------------------------------

    def _array(self, op: dict[str, Any], key: str, payloads: Sequence[BufferLike]) -> np.ndarray:
        if key not in op:
            raise BadRequestError(f"operation {op.get('op')!r} lacks array {key!r}")
        return array_from(op[key], payloads, max_bytes=self.limits.max_array_bytes)

    def _table_name(self, op: dict[str, Any]) -> str:
        name = op.get("t")
        if not isinstance(name, str):
            raise BadRequestError(f"operation {op.get('op')!r} needs a table name 't'")
        return name

    def _ids(self, op: dict[str, Any], payloads: Sequence[BufferLike]) -> np.ndarray:
        ids = self._array(op, "ids", payloads)
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise BadRequestError(f"ids must be a 1-D int64 array, got {ids.dtype} {ids.shape}")
        if ids.size > self.limits.max_ids:
            raise BadRequestError(
                f"{ids.size} ids exceed the per-request limit {self.limits.max_ids}"
            )
        return ids

    def op_create(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        created = self.store.create(spec_from_wire(op.get("spec")))
        return {"st": "OK", "created": created}

    def op_pull_dense(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.dense(self._table_name(op))
        chunks = op.get("chunks")
        if not isinstance(chunks, list) or not all(type(c) is int for c in chunks):
            raise BadRequestError("pull_dense needs 'chunks', a list of integers")
        if len(set(chunks)) != len(chunks):
            raise BadRequestError("pull_dense names a chunk twice")
        spec = table.spec
        reply_bytes = (
            sum(
                (spec.chunk_range(c)[1] - spec.chunk_range(c)[0]) if 0 <= c < spec.n_chunks else 0
                for c in chunks
            )
            * np.dtype(spec.dtype).itemsize
        )
        if reply_bytes > self.limits.max_array_bytes:
            raise BadRequestError(
                f"pull_dense of {reply_bytes} bytes exceeds the per-request "
                f"limit {self.limits.max_array_bytes}"
            )
        return {"st": "OK", "a": [enc.array(table.pull(c)) for c in chunks]}

    def op_push_dense(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.dense(self._table_name(op))
        chunk = op.get("chunk")
        if type(chunk) is not int:
            raise BadRequestError("push_dense needs an integer 'chunk'")
        grad = self._array(op, "g", payloads)
        step = self._step(op)
        if step is None:
            table.push(chunk, grad, finite=self._checked or self._known_finite(op))
            return OK
        start, stop = table.spec.chunk_range(chunk)
        if grad.shape != (stop - start,):
            raise ShapeMismatchError(
                f"dense tensor {table.spec.name!r} chunk {chunk}: expected "
                f"{stop - start} elements, got shape {grad.shape}"
            )
        self.steps.add(
            Pending(
                step,
                self._cid,
                table.spec.name,
                chunk,
                None,
                np.array(grad, dtype=table.spec.dtype),
            )
        )
        return OK

    def _known_finite(self, op: dict[str, Any]) -> bool:
        """Whether the gradient of ``op`` was checked finite as it was read: its raw
        payload, read as the dtype it was checked as (not merely the same frame)."""
        g = op.get("g")
        return (
            bool(self._finite)
            and isinstance(g, list)
            and len(g) == 4
            and type(g[0]) is int
            and g[3] == CODEC_RAW
            and self._finite.get(g[0]) == g[1]
        )

    def op_pull_rows(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.embedding(self._table_name(op))
        return {"st": "OK", "a": enc.array(table.pull(self._ids(op, payloads)))}

    def op_push_rows(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.embedding(self._table_name(op))
        ids, grad = self._ids(op, payloads), self._array(op, "g", payloads)
        step = self._step(op)
        if step is None:
            table.push(ids, grad, finite=self._checked or self._known_finite(op))
            return OK
        if grad.shape != (ids.size, table.spec.dim):
            raise ShapeMismatchError(
                f"table {table.spec.name!r}: gradients of shape "
                f"{grad.shape} for {ids.size} ids of dim {table.spec.dim}"
            )
        self.steps.add(
            Pending(
                step,
                self._cid,
                table.spec.name,
                -1,
                np.array(ids),
                np.array(grad, dtype=table.spec.dtype),
            )
        )
        return OK

    def _step(self, op: dict[str, Any]) -> int | None:
        """The sync-mode step a push belongs to (None: apply at once)."""
        step = op.get("step")
        if step is None:
            return None
        if type(step) is not int or step < 0:
            raise BadRequestError(f"'step' must be a non-negative integer, got {step!r}")
        if not self._cid:
            raise BadRequestError("a sync-mode push needs the message's 'cid'")
        return step

    def op_commit(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        step, workers = op.get("step"), op.get("workers")
        if (
            type(step) is not int
            or not isinstance(workers, list)
            or not all(isinstance(w, bytes) for w in workers)
        ):
            raise BadRequestError("commit needs an integer 'step' and 'workers', a list of ids")
        changed = self.steps.commit(self.store, step, workers)
        return {"st": "OK", "changed": changed, "committed": self.steps.committed}

    def op_checksum(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        return {"st": "OK", "checksum": self.store.checksum(), "lsn": self.lsn}

    def op_acks(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        """Nothing: a client waiting for its background pushes sends it so that the
        answers held for it come now (see zps.shard.admission.HeldAcks)."""
        return OK

    def op_tables(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        return {"st": "OK", "tables": [s.to_wire() for s in self.store.specs()]}

    # -- administration: drop, set, describe, ids, export cuts, checkpoints ----

    def op_drop(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        name = self._table_name(op)
        dropped = self.store.drop(name)
        if dropped:  # its sync-mode gradients waiting for a commit go with it
            entries = [e for e in self.steps.entries if e.table != name]
            if len(entries) != len(self.steps.entries):
                self.steps.entries = entries
                self.steps.nbytes = sum(e.nbytes for e in entries)
        return {"st": "OK", "changed": dropped}

    def op_set_dense(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.dense(self._table_name(op))
        chunk = op.get("chunk")
        if type(chunk) is not int:
            raise BadRequestError("set_dense needs an integer 'chunk'")
        state = self._state_arrays(op, payloads)
        table.set_chunk(chunk, self._array(op, "v", payloads), state)
        return OK

    def op_set_rows(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.embedding(self._table_name(op))
        state = self._state_arrays(op, payloads)
        table.set_rows(self._ids(op, payloads), self._array(op, "v", payloads), state)
        return OK

    def op_set_optimizer(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        """Give a table another optimizer (``optimizer``, its wire form): the same kind
        keeps the state, another kind only with ``"reset": true``, which starts the state
        afresh (whatever the kind).  A mutation: replicated, logged, applied once."""
        name = self._table_name(op)
        reset = op.get("reset", False)
        if not isinstance(reset, bool):
            raise BadRequestError("set_optimizer: 'reset' must be true or false")
        opt = optimizer_from_spec(op.get("optimizer"))
        changed = self.store.set_optimizer(name, opt, reset=reset)
        return {"st": "OK", "changed": changed}

    def op_advance_step(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        """Advance the step count of table ``t`` (nil: every table) by ``n`` >= 1, or set
        it to ``to`` (a table named; an import): the step a scheduled learning rate is
        evaluated at.  A mutation: replicated, logged, applied once.  Answers each
        table's new ``steps`` by name."""
        name = op.get("t")
        if name is not None and not isinstance(name, str):
            raise BadRequestError("advance_step: 't' must be a table name or nil")
        n, to = op.get("n"), op.get("to")
        if to is not None:
            if name is None or n is not None or type(to) is not int or to < 0:
                raise BadRequestError(
                    "advance_step: 'to' needs a table 't', no 'n', and an integer >= 0"
                )
            changed = self.store.set_step(name, to)
        else:
            if type(n) is not int or n < 1:
                raise BadRequestError(f"advance_step: 'n' must be an integer >= 1, got {n!r}")
            changed = self.store.advance_step(name, n)
        specs = self.store.specs() if name is None else [self.store.table(name).spec]
        return {"st": "OK", "changed": changed, "steps": {s.name: s.step for s in specs}}

    def _state_arrays(
        self, op: dict[str, Any], payloads: Sequence[BufferLike]
    ) -> dict[str, np.ndarray] | None:
        """A set's optimizer state: ``state`` names the columns, each in array ``s.KEY``
        (absent: the set resets the state)."""
        keys = op.get("state")
        if keys is None:
            return None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise BadRequestError(f"{op.get('op')}: 'state' must be a list of state column names")
        return {k: self._array(op, f"s.{k}", payloads) for k in keys}

    def op_describe(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.table(self._table_name(op))
        out = {
            "st": "OK",
            "spec": table.spec.to_wire(),
            "rows": len(table),
            "bytes": table.nbytes,
            "lsn": self.lsn,
        }
        if isinstance(table, EmbeddingTable):
            out["admitted"] = table.n_admitted()
        return out

    def op_ids(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        table = self.store.embedding(self._table_name(op))
        after, limit = op.get("after"), op.get("limit")
        if after is not None and type(after) is not int:
            raise BadRequestError("ids: 'after' must be an integer id or nil")
        if type(limit) is not int or not 1 <= limit <= self.limits.max_ids:
            raise BadRequestError(f"ids: 'limit' must be an integer in [1, {self.limits.max_ids}]")
        return {"st": "OK", "a": enc.array(table.ids_after(after, limit))}

    def op_cut(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        """Copy the values of every table (and, with ``"state": true``, their optimizer
        state) at the current LSN, to be read in pieces by ``cut_read`` while writes go
        on (see :class:`~zps.shard.cuts.Cuts`)."""
        if self.partition is None:
            raise BadRequestError("no partition to cut")
        with_state = op.get("state", False)
        if not isinstance(with_state, bool):
            raise BadRequestError("cut: 'state' must be true or false")
        return self.cuts.take(
            self.store, epoch=self.epoch, lsn=self.lsn, slots=self.slots, with_state=with_state
        )

    def op_cut_read(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        return self.cuts.read(
            op, enc, partition=self.partition, max_array_bytes=self.limits.max_array_bytes
        )

    def op_cut_drop(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        self.cuts.drop(op.get("cut"))
        return OK

    def op_checkpoint(
        self, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
    ) -> dict[str, Any]:
        """Ask for a checkpoint of the current state (with ``"write": true``) and say
        where the newest one is: ``lsn`` now, ``checkpoint`` (its ``lsn``, ``epoch``,
        ``path``, ``time``; nil if none)."""
        if not self.checkpoint_enabled:
            raise BadRequestError(
                f"the primary of partition {self.partition} has no data dir: it writes no "
                "checkpoints (start it with --data-dir)"
            )
        done = self.checkpointed["lsn"] if self.checkpointed else -1
        if op.get("write") is True and done < self.lsn:
            self.checkpoint_wanted = max(self.checkpoint_wanted or 0, self.lsn)
        return {"st": "OK", "lsn": self.lsn, "checkpoint": self.checkpointed}

    def report(self) -> dict[str, Any]:
        """Counters sent to the broker with each heartbeat."""
        s = self.stats
        return {
            "requests": s.requests,
            "ops": s.ops,
            "errors": s.errors,
            "duplicates": s.duplicates,
            "malformed": s.malformed,
            "expired": s.expired,
            "bytes_in": s.bytes_in,
            "tables": len(self.store.specs()),
            "nbytes": self.store.nbytes,
            "dedup_bytes": self.dedup.nbytes,
            "dedup_entries": len(self.dedup),
            "step_bytes": self.steps.nbytes,
        }


_Handler = Callable[[ShardCore, dict[str, Any], Sequence[BufferLike], Encoder], dict[str, Any]]
_HANDLERS: dict[str, _Handler] = {
    "create": ShardCore.op_create,
    "pull_dense": ShardCore.op_pull_dense,
    "push_dense": ShardCore.op_push_dense,
    "pull_rows": ShardCore.op_pull_rows,
    "push_rows": ShardCore.op_push_rows,
    "checksum": ShardCore.op_checksum,
    "commit": ShardCore.op_commit,
    "tables": ShardCore.op_tables,
    "acks": ShardCore.op_acks,
    "drop": ShardCore.op_drop,
    "set_dense": ShardCore.op_set_dense,
    "set_rows": ShardCore.op_set_rows,
    "set_optimizer": ShardCore.op_set_optimizer,
    "advance_step": ShardCore.op_advance_step,
    "describe": ShardCore.op_describe,
    "ids": ShardCore.op_ids,
    "cut": ShardCore.op_cut,
    "cut_read": ShardCore.op_cut_read,
    "cut_drop": ShardCore.op_cut_drop,
    "checkpoint": ShardCore.op_checkpoint,
    **slotops.HANDLERS,
}
#: The operations a shard serves (the wire names of its handlers).
SERVED: frozenset[str] = frozenset(_HANDLERS)
