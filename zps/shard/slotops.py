"""A shard's side of live resharding: which slots it serves, and the move operations.

The rule a primary applies to every request (after the dedup lookup, so a re-sent
message that was applied before a fence is answered from the dedup record), the
rule of :meth:`zps.core.reshard.SlotOwnership.check` on numpy masks:

- a slot the partition does not own and is not importing: ``MOVED``, not applied
  (the client re-splits the call by its newer map);
- a slot it is importing, or one it owns but has fenced: ``NOT_PRIMARY``, not
  applied (the client retries after a backoff; the cut-over ends soon);
- otherwise served.

A shard learns its slots from the cluster map (:meth:`SlotState.from_map`) while no
move involves it; fences and imports are operations of its request stream, so they
are replicated and logged like writes, and a promoted replica or a restarted shard
holds them.  The operations, all sent by the active broker:

- ``slots_fence`` / ``slots_unfence`` (source): stop / resume serving the slots;
- ``slots_cut`` (source, read): copy what is on the slots, to be read in pieces by
  ``slots_cut_read``: the rows of slots still served (``track``: the rows written
  from then on are listed), then, fenced, those written since (``delta``), or
  everything on fenced slots;
- ``slots_import`` (destination): a piece of the copy (rows or chunks with their
  optimizer state), written and marked as importing (``fresh``: a piece of the move's
  first copy, whose ids are inserted without a lookup where the slots held no row at
  the import's first record);
- ``slots_activate`` (destination): serve the imported slots from map ``version``;
- ``slots_release`` (source): the map gave the slots away: drop their rows (or
  leave them to ``slots_compact``, which drops them in bounded steps);
- ``slots_drop_import`` (destination): a cancelled move: drop what was imported;
- ``slots_compact``: drop the rows of slots given away, a step at a time.

No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from zps.errors import BadRequestError, ProtocolError
from zps.protocol import ops
from zps.protocol.codec import BufferLike, Encoder, array_from
from zps.protocol.ops import Operation
from zps.store import PartitionStore
from zps.store.slots import (
    Compaction,
    Tracker,
    chunk_slot,
    cut_slots,
    drop_slots,
    forget_index_slots,
    holds_rows_on,
    load_chunks,
    load_rows,
    slot_mask,
    slots_of_ids,
)
from zps.store.stepbuf import Pending, StepBuffer, is_entry

#: The operations subject to the ownership rule (they address rows, or chunks), and
#: the moves that change state (replicated and logged): the operation table's sets.
ROW_OPS, CHUNK_OPS, SLOT_MUTATIONS = ops.ROW_OPS, ops.CHUNK_OPS, ops.SLOT_MUTATIONS
OK: dict[str, Any] = {"st": "OK"}


class ArrayLimit(Protocol):
    @property
    def max_array_bytes(self) -> int: ...


class SlotHost(Protocol):
    """What the ownership rule and the move operations use of a shard's core
    (:class:`~zps.shard.core.ShardCore` has it): its partition, tables, sync-mode
    gradients and LSN, its per-request array limit, and its slot state (set by the
    first move operation)."""

    slots: SlotState | None

    @property
    def partition(self) -> int | None: ...

    @property
    def lsn(self) -> int: ...

    @property
    def store(self) -> PartitionStore: ...

    @property
    def steps(self) -> StepBuffer: ...

    @property
    def limits(self) -> ArrayLimit: ...


@dataclass
class SlotState:
    """The slots one partition serves (owned, fenced, importing), by slot."""

    owned: npt.NDArray[np.bool_]
    fenced: npt.NDArray[np.bool_]
    importing: npt.NDArray[np.bool_]
    #: The map version the owned slots match.
    version: int = 0
    #: A move involved this partition (its slots changed): requests are checked from then
    #: on.  A partition whose slots never changed is sent only slots it owns, by any map
    #: version, so it skips the check (hashing every id of every request).
    active: bool = False
    #: The source's copy of fenced slots (not replicated: a new primary has none).
    cut: dict[str, Any] | None = field(default=None, repr=False)
    cut_slots: tuple[int, ...] = ()
    #: The source's list of the rows written since it copied slots still served (a
    #: move's catch-up; not replicated: a new primary has none, and the move is cancelled).
    track: Tracker | None = field(default=None, repr=False)
    track_slots: tuple[int, ...] = ()
    #: The drop of released slots' rows under way (``slots_compact`` in steps), and the
    #: slots a finished one left without rows (not replicated: each copy has its own).
    compaction: Compaction | None = field(default=None, repr=False)
    clean: npt.NDArray[np.bool_] | None = field(default=None, repr=False)
    #: Requests this copy answered ``NOT_PRIMARY`` (fenced or importing slots), as it
    #: counted them (not replicated): the fence and release, the first import record
    #: and the activation answer it, so the broker sees whether a move refused anything.
    refused: int = 0
    #: The slots of the import under way when they held no row here at its first record
    #: (not replicated: a copy without it imports the slower way), until a piece of
    #: another copy than the first lands: a piece of that first copy (``fresh``) holds
    #: ids that are absent, each once, and is inserted without a lookup.
    vacant: npt.NDArray[np.bool_] | None = field(default=None, repr=False)

    @property
    def n_slots(self) -> int:
        return int(self.owned.shape[0])

    @property
    def moving(self) -> bool:
        return bool(self.fenced.any() or self.importing.any())

    @classmethod
    def of(cls, owned: npt.NDArray[np.bool_], version: int = 0) -> SlotState:
        n = owned.shape[0]
        return cls(owned.copy(), np.zeros(n, np.bool_), np.zeros(n, np.bool_), version)

    def take_map(self, owned: npt.NDArray[np.bool_], version: int) -> bool:
        """A newer map while no move involves this partition: its slots are the map's.
        Once a move involved it (``active``), its slots change only by the moves'
        records (an activation gives, a release takes): a map that says otherwise is
        one a broker published from an older record (a pair's takeover), and taking it
        would serve released rows, or drop slots another copy did not import; only a
        map that agrees moves the version on."""
        if self.moving or version <= self.version or owned.shape != self.owned.shape:
            return False
        if self.active:
            if not np.array_equal(owned, self.owned):
                return False
            self.version = version
            return True
        if not np.array_equal(owned, self.owned):
            self.clean = None
        self.owned = owned.copy()
        self.version = version
        return True

    def verdict(self, slots: npt.NDArray[np.int64]) -> str | None:
        """None (serve), ``"MOVED"`` or ``"NOT_PRIMARY"`` for a request on ``slots``."""
        if slots.size == 0:
            return None
        owned = self.owned[slots]
        if owned.all():
            return "NOT_PRIMARY" if self.fenced[slots].any() else None
        if (~owned & ~self.importing[slots]).any():
            return "MOVED"
        return "NOT_PRIMARY"

    def stop_tracking(self) -> None:
        if self.track is not None:
            self.track.stop()
        self.track, self.track_slots = None, ()

    def to_wire(self) -> dict[str, Any]:
        """For snapshots and checkpoints (replicated state: fences and imports too)."""
        return {
            "n": self.n_slots,
            "owned": np.packbits(self.owned).tobytes(),
            "fenced": np.packbits(self.fenced).tobytes(),
            "importing": np.packbits(self.importing).tobytes(),
            "version": self.version,
            "active": self.active,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> SlotState:
        try:
            n, version = obj["n"], obj["version"]
            if type(n) is not int or not 0 < n <= 1 << 20 or type(version) is not int:
                raise ValueError("n and version must be integers")
            masks = []
            for key in ("owned", "fenced", "importing"):
                raw = obj[key]
                if not isinstance(raw, bytes) or len(raw) != -(-n // 8):
                    raise ValueError(f"{key} must be {-(-n // 8)} bytes")
                bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[:n]
                masks.append(bits.astype(np.bool_))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequestError(f"malformed slot state: {e}") from None
        return cls(masks[0], masks[1], masks[2], version, active=obj.get("active", True) is True)

    def report(self) -> dict[str, Any]:
        return {
            "owned": int(self.owned.sum()),
            "fenced": int(self.fenced.sum()),
            "importing": int(self.importing.sum()),
            "version": self.version,
        }


def request_slots(
    state: SlotState, ops: list[Any], payloads: Sequence[BufferLike], max_bytes: int
) -> npt.NDArray[np.int64]:
    """Every slot the request's row and chunk operations touch (malformed ones are
    skipped: they fail on their own)."""
    parts: list[npt.NDArray[np.int64]] = []
    chunks: list[int] = []
    n_slots = state.n_slots
    for op in ops:
        if not isinstance(op, dict):
            continue
        name = op.get("op")
        if name in ROW_OPS:
            try:
                ids = array_from(op.get("ids"), payloads, max_bytes=max_bytes)
            except ProtocolError:
                continue
            if ids.dtype == np.int64 and ids.ndim == 1:
                parts.append(slots_of_ids(ids, n_slots))
        elif name in CHUNK_OPS:
            t = op.get("t")
            if not isinstance(t, str):
                continue
            cs = op.get("chunks") if name == Operation.PULL_DENSE else [op.get("chunk")]
            if isinstance(cs, list):
                chunks.extend(chunk_slot(t, c, n_slots) for c in cs if type(c) is int)
    if chunks:
        parts.append(np.asarray(chunks, dtype=np.int64))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def check(core: SlotHost, ops: list[Any], payloads: Sequence[BufferLike]) -> dict[str, Any] | None:
    """The refusal of a request by the ownership rule (None: serve it)."""
    state = core.slots
    if state is None or not state.active:
        return None
    slots = request_slots(state, ops, payloads, core.limits.max_array_bytes)
    verdict = state.verdict(slots)
    if verdict is None:
        return None
    if verdict == "MOVED":
        return {
            "st": "MOVED",
            "msg": f"partition {core.partition} no longer holds some of these ids "
            f"(map version {state.version}): split the call by the new map",
        }
    state.refused += 1
    return {
        "st": "NOT_PRIMARY",
        "msg": f"partition {core.partition}: slots of this request are being moved; retry",
    }


# -- operations ---------------------------------------------------------------


def _slots(op: dict[str, Any], n_slots: int, key: str = "slots") -> npt.NDArray[np.bool_]:
    raw = op.get(key)
    if not isinstance(raw, list) or not all(type(s) is int for s in raw):
        raise BadRequestError(f"{op.get('op')} needs {key!r}, a list of slots")
    return slot_mask(raw, n_slots)


def _state(core: SlotHost, op: dict[str, Any]) -> SlotState:
    """The partition's slot state; the first move operation sets it from the map's
    slots the broker sends along (``owned``, ``n_slots``, ``version``)."""
    if core.slots is not None:
        core.slots.active = True
        return core.slots
    n_slots, version = op.get("n_slots"), op.get("version", 0)
    if type(n_slots) is not int or not 0 < n_slots <= 1 << 20 or type(version) is not int:
        raise BadRequestError(f"{op.get('op')} needs 'n_slots' and 'version'")
    core.slots = SlotState.of(_slots(op, n_slots, "owned"), version)
    core.slots.active = True
    return core.slots


def op_slots_fence(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    state = _state(core, op)
    mask = _slots(op, state.n_slots)
    if (mask & ~state.owned).any():
        raise BadRequestError("only slots this partition owns can be fenced")
    held = bool((state.fenced[mask]).all())
    state.fenced |= mask
    return {"st": "OK", "held": held, "refused": state.refused}


def op_slots_unfence(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    state = _state(core, op)
    state.fenced &= ~_slots(op, state.n_slots)
    state.cut, state.cut_slots = None, ()
    state.stop_tracking()
    return OK


def op_slots_cut(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    """Copy what is on the slots, to be read by ``slots_cut_read``:

    - ``track``: slots still served (a move's catch-up, first stage): their embedding
      rows now, and from now on a list of the rows written;
    - ``delta`` (fenced slots, after ``track``): the rows written since, every dense
      chunk and sync-mode gradient on the slots; or ``rebuilt`` (nothing cut) when a
      table was rebuilt meanwhile (eviction, a drop): the copy must start again;
    - neither (fenced slots): everything on them.
    """
    track, delta = op.get("track") is True, op.get("delta") is True
    state = _state(core, op) if track else core.slots
    if state is None:
        raise BadRequestError("no slot is fenced on this partition")
    mask = _slots(op, state.n_slots)
    slots = tuple(int(s) for s in np.flatnonzero(mask))
    if track:
        if (mask & ~state.owned).any():
            raise BadRequestError("slots_cut: only slots this partition owns")
        state.stop_tracking()
        state.cut = cut_slots(core.store, mask)
        state.cut["steps"] = []
        state.track, state.track_slots = Tracker(core.store), slots
    else:
        if (mask & ~state.fenced).any():
            raise BadRequestError("slots_cut: fence the slots first")
        changed = None
        if delta:
            if state.track is None or state.track_slots != slots:
                raise BadRequestError(
                    f"partition {core.partition} holds no list of the rows written to these "
                    "slots (its primary changed): the move starts again"
                )
            changed = state.track.changed()
            state.stop_tracking()
            if changed is None:
                state.cut, state.cut_slots = None, ()
                return {"st": "OK", "rebuilt": True}
        state.cut = cut_slots(core.store, mask, changed)
        state.cut["steps"] = _cut_steps(core, mask)
    state.cut_slots = slots
    tables = []
    rows = 0
    for wire in state.cut["specs"]:
        data = state.cut["tables"][wire["name"]]
        if "ids" in data:
            row = data["rows"].nbytes + sum(
                a.nbytes for k, a in data.items() if k not in ("ids", "rows")
            )
            n = int(data["ids"].shape[0])
            rows += n
            tables.append({"spec": wire, "n": n, "row_bytes": 8 + row // max(n, 1)})
        else:
            sizes = [
                int(v.nbytes + sum(a.nbytes for a in st.values()))
                for v, st in zip(data["values"], data["state"], strict=True)
            ]
            tables.append({"spec": wire, "chunks": data["chunks"].tolist(), "sizes": sizes})
    out = {"st": "OK", "tables": tables, "lsn": core.lsn, "rows": rows}
    if not track:
        out |= {"steps": len(state.cut["steps"]), "committed": core.steps.committed}
    return out


def _cut_steps(core: SlotHost, mask: npt.NDArray[np.bool_]) -> list[Pending]:
    """Sync-mode gradients waiting for their step, of the rows and chunks on ``mask``."""
    n_slots = mask.shape[0]
    out = []
    for e in core.steps.entries:
        if e.ids is None:
            if mask[chunk_slot(e.table, e.chunk, n_slots)]:
                out.append(e)
            continue
        on = mask[slots_of_ids(e.ids, n_slots)]
        if on.all():
            out.append(e)
        elif on.any():
            out.append(Pending(e.step, e.cid, e.table, e.chunk, e.ids[on], e.grad[on]))
    return out


def op_slots_cut_read(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    """Rows ``[start, start+count)`` of an embedding table of the cut (``a``: a map of
    arrays), or dense ``chunks`` (``a``: ``[values, {state}]`` per chunk)."""
    state = core.slots
    if state is None or state.cut is None:
        raise BadRequestError("no slot cut on this partition (take one with slots_cut)")
    if op.get("steps") is True:
        return {
            "st": "OK",
            "a": [
                [
                    e.step,
                    e.cid,
                    e.table,
                    e.chunk,
                    None if e.ids is None else enc.array(e.ids),
                    enc.array(e.grad),
                ]
                for e in state.cut["steps"]
            ],
        }
    name = op.get("t")
    data = state.cut["tables"].get(name) if isinstance(name, str) else None
    if data is None:
        raise BadRequestError(f"table {name!r} is not in the slot cut")
    if "ids" in data:
        start, count = op.get("start"), op.get("count")
        if type(start) is not int or type(count) is not int or start < 0 or count < 0:
            raise BadRequestError("slots_cut_read needs integers 'start' and 'count'")
        return {
            "st": "OK",
            "a": {k: enc.array(a[start : start + count]) for k, a in data.items()},
        }
    want = op.get("chunks")
    if not isinstance(want, list):
        raise BadRequestError("slots_cut_read of a dense tensor needs 'chunks'")
    index = {int(c): i for i, c in enumerate(data["chunks"].tolist())}
    out = []
    for c in want:
        i = index.get(c) if type(c) is int else None
        if i is None:
            raise BadRequestError(f"chunk {c!r} is not in the slot cut")
        out.append(
            [
                enc.array(data["values"][i]),
                {k: enc.array(a) for k, a in data["state"][i].items()},
            ]
        )
    return {"st": "OK", "a": out}


def op_slots_import(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    """A piece of a move's copy: ``spec`` and ``a`` as ``slots_cut_read`` answered it
    (``chunks`` too for a dense tensor); ``slots`` are marked as importing."""
    state = _state(core, op)
    mask = _slots(op, state.n_slots)
    if (mask & state.owned).any():
        raise BadRequestError("a partition cannot import a slot it owns")
    state.importing |= mask
    state.clean = None  # rows arrive on these slots
    spec, desc = op.get("spec"), op.get("a")
    limit = core.limits.max_array_bytes
    committed = op.get("committed")
    if type(committed) is int and committed > core.steps.committed:
        # A new partition takes the sync-mode step its source had committed.
        core.steps.committed = committed
    fresh = op.get("fresh") is True
    if not fresh:
        state.vacant = None
    if op.get("steps") is True:
        _import_steps(core, desc, payloads, limit)
        return OK
    if spec is None:  # the move's first record: only the slots
        state.vacant = None if holds_rows_on(core.store, mask) else mask
        return {"st": "OK", "refused": state.refused}
    if isinstance(desc, dict):
        arrays = {str(k): array_from(d, payloads, max_bytes=limit) for k, d in desc.items()}
        vacant = state.vacant
        absent = fresh and vacant is not None and not bool((mask & ~vacant).any())
        load_rows(core.store, spec, arrays, absent=absent)
        return OK
    chunks = op.get("chunks")
    if not isinstance(desc, list) or not isinstance(chunks, list) or len(chunks) != len(desc):
        raise BadRequestError("slots_import needs 'a' (rows or chunks) and 'chunks'")
    values, states = [], []
    for item in desc:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], dict):
            raise BadRequestError("slots_import: a chunk is [values, {state}]")
        values.append(array_from(item[0], payloads, max_bytes=limit))
        states.append(
            {str(k): array_from(d, payloads, max_bytes=limit) for k, d in item[1].items()}
        )
    load_chunks(core.store, spec, chunks, values, states)
    return OK


def op_slots_activate(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    state = _state(core, op)
    mask = _slots(op, state.n_slots)
    version = op.get("version")
    if type(version) is not int:
        raise BadRequestError("slots_activate needs the map 'version'")
    state.importing &= ~mask
    state.owned |= mask
    state.version = max(state.version, version)
    state.vacant = None
    return {"st": "OK", "refused": state.refused}


def op_slots_release(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    state = _state(core, op)
    mask = _slots(op, state.n_slots)
    version = op.get("version")
    if type(version) is not int:
        raise BadRequestError("slots_release needs the map 'version'")
    # The rows go now, or (``"drop": false``) at the resharding's end with
    # ``slots_compact``: dropping rewrites the partition's index, once is enough.
    dropped = drop_slots(core.store, mask) if op.get("drop", True) is not False else 0
    _drop_steps(core, mask)
    state.owned &= ~mask
    state.fenced &= ~mask
    state.version = max(state.version, version)
    state.cut, state.cut_slots = None, ()
    state.stop_tracking()
    return {"st": "OK", "dropped": dropped, "refused": state.refused}


def op_slots_compact(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    """Drop every row and chunk on a slot this partition neither owns nor imports (what
    releases without ``drop`` left behind).  ``rows`` > 0: one step of at most that many
    rows' worth of work (:class:`~zps.store.slots.Compaction`; the answer says whether
    it is ``done``), so the shard serves between steps; without: all that is left, at
    once (each copy of the partition ends without those rows, wherever it was)."""
    state = core.slots
    if state is None:
        return {"st": "OK", "dropped": 0, "done": True}
    rows = op.get("rows", 0)
    if type(rows) is not int:
        raise BadRequestError("slots_compact: 'rows' must be an integer")
    mask = ~state.owned & ~state.importing
    if state.clean is not None and not bool((mask & ~state.clean).any()):
        # Done already: rows reach a slot only while it is imported or owned, and
        # either clears ``clean``.
        state.compaction = None
        return {"st": "OK", "dropped": 0, "done": True}
    comp = state.compaction
    if comp is None or not np.array_equal(comp.mask, mask):
        if comp is not None:  # the slots changed meanwhile: start again
            comp.abandon()
        comp = state.compaction = Compaction(core.store, mask)
    dropped, done = comp.step(rows)
    if done:
        state.compaction = None
        state.clean = mask
        if not state.moving:
            forget_index_slots(core.store)
    return {"st": "OK", "dropped": dropped, "done": done, "steps": comp.steps}


def op_slots_drop_import(
    core: SlotHost, op: dict[str, Any], payloads: Sequence[BufferLike], enc: Encoder
) -> dict[str, Any]:
    state = _state(core, op)
    mask = _slots(op, state.n_slots) & ~state.owned
    dropped = drop_slots(core.store, mask)
    _drop_steps(core, mask)  # sync-mode gradients imported with the slots go too
    state.importing &= ~mask
    state.vacant = None
    return {"st": "OK", "dropped": dropped}


def _import_steps(core: SlotHost, desc: object, payloads: Sequence[BufferLike], limit: int) -> None:
    if not isinstance(desc, list):
        raise BadRequestError("slots_import of steps needs 'a', a list of entries")
    entries = []
    for e in desc:
        if not is_entry(e):
            raise BadRequestError("slots_import: a malformed step entry")
        ids = None if e[4] is None else np.array(array_from(e[4], payloads, max_bytes=limit))
        grad = np.array(array_from(e[5], payloads, max_bytes=limit))
        entries.append(Pending(e[0], e[1], e[2], e[3], ids, grad))
    steps = core.steps
    steps.entries.extend(entries)
    steps.nbytes = sum(x.nbytes for x in steps.entries)


def owned_only(state: SlotState, tables: dict[str, Any]) -> None:
    """Filter an export cut (``ShardCore.op_cut``'s copies) to the owned slots."""
    n_slots = state.n_slots
    for name, data in tables.items():
        if isinstance(data, tuple):  # (ids, rows) or (ids, rows, {column: state})
            ids = data[0]
            keep = state.owned[slots_of_ids(ids, n_slots)]
            if not keep.all():
                kept = [a[keep] for a in data[:2]]
                if len(data) > 2:
                    kept.append({k: a[keep] for k, a in data[2].items()})
                tables[name] = tuple(kept)
        else:
            for c in [c for c in data if not state.owned[chunk_slot(name, c, n_slots)]]:
                del data[c]


def _drop_steps(core: SlotHost, mask: npt.NDArray[np.bool_]) -> None:
    """Sync-mode gradients waiting for their step, of rows or chunks on ``mask`` (they
    went to the destination with the slots; the broker commits no step meanwhile)."""
    steps = core.steps
    if not steps.entries:
        return
    n_slots = mask.shape[0]
    kept = []
    for e in steps.entries:
        if e.ids is None:
            if not mask[chunk_slot(e.table, e.chunk, n_slots)]:
                kept.append(e)
        else:
            on = mask[slots_of_ids(e.ids, n_slots)]
            if not on.any():
                kept.append(e)
            elif not on.all():
                kept.append(Pending(e.step, e.cid, e.table, e.chunk, e.ids[~on], e.grad[~on]))
    steps.entries = kept
    steps.nbytes = sum(e.nbytes for e in kept)


HANDLERS = {
    "slots_fence": op_slots_fence,
    "slots_unfence": op_slots_unfence,
    "slots_cut": op_slots_cut,
    "slots_cut_read": op_slots_cut_read,
    "slots_import": op_slots_import,
    "slots_activate": op_slots_activate,
    "slots_release": op_slots_release,
    "slots_drop_import": op_slots_drop_import,
    "slots_compact": op_slots_compact,
}
