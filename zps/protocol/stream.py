"""The typed records of replication between a replica and its primary (subscription,
stream acknowledgements, records, snapshot chunks), by the rules of
:mod:`zps.protocol.messages`.  Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zps.errors import ProtocolError
from zps.protocol.fields import (
    Header,
    _field,
    _int,
)

# -- replication, replica <-> primary ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Subscribe:
    """SUBSCRIBE, replica -> primary: send me ``partition`` at ``epoch`` (a snapshot, then
    the stream).  ``abandoned`` names a snapshot transfer the replica gave up, to be
    replaced by a new one.  ``host``: the replica's shared-memory host key
    (:func:`zps.shm.host_key`), when it reads large stream frames from the primary's
    shared memory; absent, every frame comes inline.  ``checksums``: the names of the
    checksums a snapshot stream may end with that the replica reads
    (:data:`zps.store.snapshot.CHECKSUMS`); absent (a replica of an earlier release), it
    reads only SHA-256, and its snapshot is sent so."""

    partition: int | None
    epoch: int
    abandoned: int | None = None
    host: str | None = None
    checksums: tuple[str, ...] = ()

    @classmethod
    def parse(cls, h: Header) -> Subscribe:
        partition, abandoned, host = h.get("partition"), h.get("abandoned"), h.get("host")
        if host is not None and (not isinstance(host, str) or len(host) > 256):
            raise ProtocolError("SUBSCRIBE host must be a string of at most 256 characters")
        checksums = h.get("checksums", [])
        if (
            not isinstance(checksums, list)
            or len(checksums) > 8
            or not all(isinstance(c, str) and len(c) <= 32 for c in checksums)
        ):
            raise ProtocolError(
                "SUBSCRIBE checksums must be a list of at most 8 names of at most 32 characters"
            )
        return cls(
            partition=None if partition is None else _int(partition, "SUBSCRIBE partition"),
            epoch=_int(_field(h, "epoch", "SUBSCRIBE"), "SUBSCRIBE epoch"),
            abandoned=None if abandoned is None else _int(abandoned, "SUBSCRIBE abandoned"),
            host=host,
            checksums=tuple(checksums),
        )

    def to_wire(self) -> dict[str, Any]:
        h: dict[str, Any] = {"partition": self.partition, "epoch": self.epoch}
        if self.abandoned is not None:
            h["abandoned"] = self.abandoned
        if self.host is not None:
            h["host"] = self.host
        if self.checksums:
            h["checksums"] = list(self.checksums)
        return h


@dataclass(frozen=True, slots=True)
class StreamAck:
    """ACK, replica -> primary: everything up to ``lsn`` is applied, at ``epoch``, on top
    of the snapshot at LSN ``base`` (-1: none loaded; nil from a peer that names none)."""

    lsn: int
    epoch: int
    base: int | None = None

    @classmethod
    def parse(cls, h: Header) -> StreamAck:
        base = h.get("base")
        return cls(
            lsn=_int(_field(h, "lsn", "ACK"), "ACK lsn"),
            epoch=_int(_field(h, "epoch", "ACK"), "ACK epoch"),
            base=None if base is None else _int(base, "ACK base", lo=-1),
        )

    def to_wire(self) -> dict[str, Any]:
        return {"lsn": self.lsn, "epoch": self.epoch, "base": self.base}


@dataclass(frozen=True, slots=True)
class Replicate:
    """REPLICATE's header, primary -> replica: the request that follows (its header and
    payload frames as the client sent them) took the partition from LSN ``prev`` to
    ``lsn``; the epoch travels in the route.  ``checked``: every operation of it
    succeeded on the primary (its gradients are finite: a replica skips that check)."""

    prev: int
    lsn: int
    checked: bool = False

    @classmethod
    def parse(cls, h: Header) -> Replicate:
        return cls(
            prev=_int(_field(h, "prev", "REPLICATE"), "REPLICATE prev"),
            lsn=_int(_field(h, "lsn", "REPLICATE"), "REPLICATE lsn"),
            checked=h.get("ok") is True,
        )

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"prev": self.prev, "lsn": self.lsn}
        if self.checked:
            wire["ok"] = True
        return wire


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    """SNAPSHOT_CHUNK's header, primary -> replica: chunk ``seq`` of the ``count`` chunks
    of snapshot ``id``, ``total`` bytes at LSN ``lsn`` cut into chunks of ``chunk``
    bytes; the payload frames carry the chunk's bytes.  Whether the sizes agree is the
    assembly's to check (:class:`~zps.store.snapshot.ChunkAssembly`)."""

    id: int
    seq: int
    count: int
    total: int
    chunk: int
    lsn: int

    @classmethod
    def parse(cls, h: Header) -> SnapshotChunk:
        def need(key: str) -> int:
            return _int(_field(h, key, "SNAPSHOT_CHUNK"), f"SNAPSHOT_CHUNK {key}")

        return cls(
            id=need("id"),
            seq=need("seq"),
            count=need("count"),
            total=need("total"),
            chunk=need("chunk"),
            lsn=need("lsn"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "seq": self.seq,
            "count": self.count,
            "total": self.total,
            "chunk": self.chunk,
            "lsn": self.lsn,
        }


@dataclass(frozen=True, slots=True)
class SnapshotAck:
    """SNAPSHOT_ACK, replica -> primary: chunk ``seq`` of snapshot ``id`` arrived."""

    id: int
    seq: int

    @classmethod
    def parse(cls, h: Header) -> SnapshotAck:
        return cls(
            id=_int(_field(h, "id", "SNAPSHOT_ACK"), "SNAPSHOT_ACK id"),
            seq=_int(_field(h, "seq", "SNAPSHOT_ACK"), "SNAPSHOT_ACK seq"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "seq": self.seq}


#: What the broker accepts as control messages, from shards and from clients.
