"""A partition's whole state as one message: snapshot encoding, without I/O.

Used to bring a replica up to date (snapshot at LSN L, then the stream from
L+1).  The header carries the table specs, the LSN, the epoch and the dedup
record; every array travels as a payload frame (see :mod:`zps.protocol.codec`).

Rule: :func:`decode_snapshot` returns a complete, validated snapshot or raises
:class:`~zps.errors.ProtocolError`; a half-read snapshot is never loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zps.errors import ProtocolError
from zps.protocol.codec import BufferLike, Encoder, array_from

DedupEntry = tuple[bytes, int, list[dict[str, Any]]]


@dataclass(frozen=True)
class Snapshot:
    partition: int
    epoch: int
    lsn: int
    export: dict[str, Any]  # as PartitionStore.export() returns it
    dedup: list[DedupEntry]
    #: Sync-mode gradients waiting for their step's commit (StepBuffer.export()).
    steps: dict[str, Any] = field(default_factory=lambda: {"committed": -1, "entries": []})


def encode_snapshot(enc: Encoder, snap: Snapshot) -> dict[str, Any]:
    """Add the snapshot's arrays to ``enc``; return the header to send with them."""
    tables = {
        name: {key: enc.array(arr) for key, arr in arrays.items()}
        for name, arrays in snap.export["tables"].items()
    }
    return {
        "partition": snap.partition,
        "epoch": snap.epoch,
        "lsn": snap.lsn,
        "specs": snap.export["specs"],
        "tables": tables,
        "dedup": [[cid, seq, statuses] for cid, seq, statuses in snap.dedup],
        "steps": {
            "committed": snap.steps["committed"],
            "entries": [
                [step, cid, table, chunk, None if ids is None else enc.array(ids), enc.array(g)]
                for step, cid, table, chunk, ids, g in snap.steps["entries"]
            ],
        },
    }


def decode_snapshot(
    header: dict[str, Any], payloads: Sequence[BufferLike], *, max_bytes: int
) -> Snapshot:
    try:
        partition, epoch, lsn = header["partition"], header["epoch"], header["lsn"]
        specs, tables, dedup = header["specs"], header["tables"], header["dedup"]
    except KeyError as e:
        raise ProtocolError(f"snapshot header lacks {e}") from None
    if not all(type(v) is int and v >= 0 for v in (partition, epoch, lsn)):
        raise ProtocolError("snapshot partition, epoch and lsn must be non-negative integers")
    if not isinstance(specs, list) or not isinstance(tables, dict) or not isinstance(dedup, list):
        raise ProtocolError("snapshot specs/tables/dedup have the wrong types")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name, descs in tables.items():
        if not isinstance(name, str) or not isinstance(descs, dict):
            raise ProtocolError("snapshot tables must map names to array maps")
        # copies: a loaded table must own writable arrays, not views of frames
        arrays[name] = {
            str(k): np.array(array_from(d, payloads, max_bytes=max_bytes)) for k, d in descs.items()
        }
    entries: list[DedupEntry] = []
    for entry in dedup:
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or not isinstance(entry[0], bytes)
            or type(entry[1]) is not int
            or not isinstance(entry[2], list)
        ):
            raise ProtocolError("snapshot dedup entries must be [cid, seq, statuses]")
        entries.append((entry[0], entry[1], entry[2]))
    steps = header.get("steps", {"committed": -1, "entries": []})
    try:
        pending = [
            [
                s,
                cid,
                t,
                c,
                None if ids is None else np.array(array_from(ids, payloads, max_bytes=max_bytes)),
                np.array(array_from(g, payloads, max_bytes=max_bytes)),
            ]
            for s, cid, t, c, ids, g in steps["entries"]
        ]
        step_state = {"committed": steps["committed"], "entries": pending}
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"snapshot step buffer is malformed: {e}") from None
    return Snapshot(partition, epoch, lsn, {"specs": specs, "tables": arrays}, entries, step_state)
