"""Snapshots for joining replicas, in bounded chunks: the primary's sender.

A replica that subscribes gets the partition as the checkpoint byte stream
(:func:`zps.shard.checkpoint.encode_checkpoint`: header, arrays, XXH3-128) cut
into chunks of at most ``chunk_bytes`` (:func:`zps.store.snapstream.plan_chunks`),
each a ``SNAPSHOT_CHUNK`` message.  At most ``window`` chunks are unacknowledged
at once: the replica answers each with ``SNAPSHOT_ACK``, so a slow replica slows
only its own transfer and the primary holds one copy of the partition plus the
chunks in flight.  The stream of writes from the snapshot's LSN follows at once;
the replica keeps it until the snapshot is loaded (:mod:`zps.shard.replica`).

Invariants: at most one transfer per replica (a SUBSCRIBE while one runs leaves
it running, unless it names that transfer as abandoned); the event loop only
takes the cut, which freezes the rows rather than copying them
(:func:`zps.shard.checkpoint.cut`); each chunk is read from the frozen version into
a buffer of its own in a worker thread, and the checksum is taken in another as
the chunks go (a chunk is hashed after it is posted, the checksum sent once every
byte before it is hashed), so no pass over the partition comes before the first
chunk; each range of the frozen version is released (on the loop) as soon as a chunk
has read it, so the primary holds, per transfer, the pages written meanwhile in the
ranges not yet sent and at most ``window + 2`` chunks, never a copy of the partition;
a transfer nobody acknowledges for ``timeout`` seconds is given up and the replica is
dropped (it subscribes again).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import Role, SnapshotAck, SnapshotChunk
from zps.shard.checkpoint import Digest, cut, encode_parts, release, thawed
from zps.shard.core import ShardCore
from zps.shard.session import ShardSession
from zps.store.checksums import CHECKSUMS, magic_for
from zps.store.snapshot import (
    CutSpace,
    FrozenPart,
    Part,
    Snapshot,
    cut_space,
    drop_pages,
    read_part,
)
from zps.store.snapstream import DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_WINDOW, Piece, plan_chunks

log = logging.getLogger("zps.shard")


#: How long a cut waits for another's frozen version before it copies the tables.
THAW_WAIT = 60.0


async def prepare(core: ShardCore, wait: float = THAW_WAIT) -> CutSpace:
    """Ready for a cut of ``core``'s partition, which the caller takes on the loop with
    no await in between: no other cut holds a frozen version (one at a time), and
    buffers, their pages touched off the loop, for the tables that cannot be frozen
    (small ones, or all of them if the other cut outlives ``wait`` seconds: then they
    are copied).  Cuts waiting for the same release go one at a time: a space that no
    longer fits when its buffers are touched (another cut froze the tables meanwhile)
    is prepared again once that cut is released, never used to copy the tables into
    memory nobody touched.  The page-table entries of the arrays to freeze are dropped
    off the loop too (:func:`zps.store.snapshot.drop_pages`)."""
    deadline = time.monotonic() + wait
    while True:
        await thawed(max(0.0, deadline - time.monotonic()))
        space = cut_space(core.store, frozen=True)
        await asyncio.to_thread(space.prefault)
        # The page-table entries of the arrays to freeze, dropped off the loop: the
        # freeze then drops only those of the pages touched since.
        await asyncio.to_thread(drop_pages, core.store)
        if space.fits(core.store):
            return space


def _encode(snap: Snapshot, magic: bytes) -> list[Part]:
    # Rows stay in storage order: a table loads them in any order, and sorting
    # would cost a second copy of the partition while it is sent.  The checksum is
    # taken as the chunks go (see SnapshotSender._send), not in a pass before the first.
    return encode_parts(snap, magic)


def _fill(parts: list[Part], pieces: tuple[Piece, ...], size: int) -> memoryview:
    """A chunk's bytes, read from the stream's parts into a buffer of its own."""
    return _fill_into(parts, pieces, np.empty(size, np.uint8).data)


def _fill_into(parts: list[Part], pieces: tuple[Piece, ...], out: memoryview) -> memoryview:
    """A chunk's bytes, read from the stream's parts into ``out`` (of their size)."""
    pos = 0
    for i, a, b in pieces:
        read_part(parts[i], a, b, out[pos:])
        pos += b - a
    return out


class _Buffers:
    """The buffers a transfer reads its chunks into, each used again once its chunk is
    acknowledged (the replica has it all, so the socket no longer reads it: chunks go
    without a copy) and hashed: a new buffer's pages cost a fault and the kernel's
    clearing of each (more CPU than the read into it), a buffer used again neither."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._free: list[np.ndarray] = []
        self._used: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        #: Chunks fed to the checksum, in order.
        self.hashed = 0

    def take(self, seq: int, acked: int, size: int) -> memoryview:
        """A buffer of ``size`` bytes for chunk ``seq``, chunks up to ``acked`` acknowledged."""
        done = min(acked + 1, self.hashed)
        while self._used and self._used[0][0] < done:
            self._free.append(self._used.popleft()[1])
        buf = self._free.pop() if self._free else np.empty(self._size, np.uint8)
        self._used.append((seq, buf))
        return buf[:size].data


def _give_back(parts: list[Part], pieces: tuple[Piece, ...]) -> int:
    """Release what of the frozen version a chunk's ``pieces`` read (on the loop, which
    writes the tables): the pages written there since the cut are copied back and held
    no longer.  The bytes copied back."""
    written = 0
    for i, _a, b in pieces:
        part = parts[i]
        if isinstance(part, FrozenPart):
            written += part.version.release_to(part.start + b)
    return written


async def _fed(
    before: asyncio.Future[None] | None,
    digest: Digest,
    views: list[memoryview],
    buffers: _Buffers,
) -> None:
    """Feed ``views`` (a chunk) to ``digest`` in a worker thread, once ``before`` has fed
    its own; counted in ``buffers``."""
    if before is not None:
        await before
    await asyncio.to_thread(digest.feed, views)
    buffers.hashed += 1


@dataclass
class _Transfer:
    snapshot_id: int
    epoch: int
    magic: bytes  # names the checksum the stream ends with: one the replica reads
    acked: int = -1  # highest chunk acknowledged
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class SnapshotSender:
    """The primary's snapshot transfers, at most one per replica."""

    def __init__(
        self,
        session: ShardSession[Any],
        core: ShardCore,
        *,
        post: Callable[[str, list[Any]], bool],
        drop: Callable[[str, str], None],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = DEFAULT_CHUNK_WINDOW,
        timeout: float = 30.0,
    ) -> None:
        self.session = session
        self.core = core
        self._post = post  # send to a replica without waiting; False: it cannot take it
        self._drop = drop
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.timeout = timeout
        #: Snapshots begun, completed (every chunk acknowledged), and chunks sent.
        self.started = 0
        self.completed = 0
        self.chunks_sent = 0
        self._transfers: dict[str, _Transfer] = {}
        self._ids = itertools.count(1)

    def in_progress(self, node: str) -> bool:
        return node in self._transfers

    def subscribe(
        self, node: str, abandoned: object = None, readable: tuple[str, ...] = ()
    ) -> bool:
        """``node`` subscribed: start its snapshot unless one is already on its way.

        ``abandoned`` is the id of a transfer the replica gave up (a bad chunk);
        that one is replaced.  ``readable``: the checksums the replica reads (none
        named: SHA-256 only, a replica of an earlier release).  Returns True if a
        transfer started.
        """
        running = self._transfers.get(node)
        if running is not None:
            if abandoned is None or abandoned != running.snapshot_id:
                return False
            self.cancel(node)
        transfer = _Transfer(next(self._ids), self.core.epoch, magic_for(readable))
        self._transfers[node] = transfer
        self.started += 1
        # A follower from now on, at the LSN it is accepted at (its snapshot's, once
        # cut, replaces it): the writes taken until the cut are in the snapshot, and
        # with write_while_repairing they need not wait for the cut (which waits for
        # another cut to end and holds the loop for a time that grows with the
        # partition) to be acknowledged on this primary's log.
        self.session.subscribed(
            node, self.core.lsn, time.monotonic(), snapshot_bytes=self._held_bytes()
        )
        transfer.task = asyncio.create_task(self._run(node, transfer))
        return True

    def _held_bytes(self) -> int:
        """What of a snapshot may be held for one transfer at once: the chunks in flight."""
        return (self.window + 1) * (self.chunk_bytes + 4096)

    def acked(self, node: str, ack: SnapshotAck) -> None:
        transfer = self._transfers.get(node)
        if transfer is None or ack.id != transfer.snapshot_id:
            return
        if ack.seq > transfer.acked:
            transfer.acked = ack.seq
            transfer.progress.set()

    def cancel(self, node: str) -> None:
        transfer = self._transfers.pop(node, None)
        if transfer is not None and transfer.task is not None:
            transfer.task.cancel()

    def close(self) -> None:
        for node in list(self._transfers):
            self.cancel(node)

    def _current(self, node: str, transfer: _Transfer) -> bool:
        return (
            self._transfers.get(node) is transfer
            and self.session.role is Role.PRIMARY
            and self.core.epoch == transfer.epoch
        )

    async def _run(self, node: str, transfer: _Transfer) -> None:
        try:
            await self._send(node, transfer)
        finally:
            if self._transfers.get(node) is transfer:
                del self._transfers[node]

    def _give_up(self, node: str, transfer: _Transfer, why: str) -> None:
        if self._transfers.get(node) is transfer:
            del self._transfers[node]
            self._drop(node, why)

    async def _send(self, node: str, transfer: _Transfer) -> None:
        space = await prepare(self.core)
        if not self._current(node, transfer) or self.core.partition is None:
            return
        # On the loop, with no await in between: the cut and the start of the stream.
        began = time.monotonic()
        snap = cut(self.core, space)
        cut_s = time.monotonic() - began
        del space
        try:
            await self._stream(node, transfer, snap, cut_s)
        finally:
            release(snap)  # on the loop, which writes the tables

    async def _stream(
        self, node: str, transfer: _Transfer, snap: Snapshot, cut_s: float = 0.0
    ) -> None:
        self.session.subscribed(node, snap.lsn, time.monotonic(), snapshot_bytes=self._held_bytes())
        partition, epoch, lsn = snap.partition, snap.epoch, snap.lsn
        t0 = time.monotonic()
        parts = await asyncio.to_thread(_encode, snap, transfer.magic)
        # The stream's last part is its checksum: each chunk is fed to it in a worker
        # thread once posted, and it is known when every chunk before it is hashed.
        last = len(parts)
        digest_bytes = CHECKSUMS[transfer.magic].size
        plan = plan_chunks([*(len(p) for p in parts), digest_bytes], self.chunk_bytes)
        bodies = [tuple(p for p in pieces if p[0] < last) for pieces in plan.chunks]
        digest = Digest(plan.total)
        hashing: asyncio.Future[None] | None = None
        buffers = _Buffers(plan.chunk_bytes)
        # The next chunk is read while this one waits for room: (seq, its read).
        reading: tuple[int, asyncio.Future[memoryview]] | None = None
        given_back = 0  # bytes written during the transfer, copied back as it went
        log.info(
            "replica %s subscribed: snapshot %d at LSN %d, %d bytes in %d chunks, %s "
            "(cut in %.3fs)",
            node,
            transfer.snapshot_id,
            lsn,
            plan.total,
            plan.count,
            CHECKSUMS[transfer.magic].name,
            cut_s,
        )
        route = Route(MsgType.SNAPSHOT_CHUNK, partition, epoch, lsn).pack()

        def read(seq: int) -> tuple[int, asyncio.Future[memoryview]] | None:
            body = bodies[seq] if seq < plan.count else ()
            if not body:
                return None
            size = sum(b - a for _, a, b in body)
            buf = buffers.take(seq, transfer.acked, size)
            return seq, asyncio.ensure_future(asyncio.to_thread(_fill_into, parts, body, buf))

        try:
            for seq, pieces in enumerate(plan.chunks):
                if reading is None or reading[0] != seq:
                    reading = read(seq)
                if not await self._room(node, transfer, seq):
                    return
                header = SnapshotChunk(
                    transfer.snapshot_id, seq, plan.count, plan.total, plan.chunk_bytes, lsn
                )
                body = bodies[seq]
                data = [await reading[1]] if reading is not None else []
                reading = None
                given_back += _give_back(parts, body)
                if seq == plan.count - 1:
                    release(snap)  # every byte of it is read
                if not self._current(node, transfer):
                    return
                payload = list(data)
                if len(body) < len(pieces):  # (part of) the checksum: after all the rest
                    hashing = asyncio.ensure_future(_fed(hashing, digest, data, buffers))
                    await hashing
                    if not self._current(node, transfer):
                        return
                    sums = memoryview(digest.digest())
                    payload += [sums[a:b] for i, a, b in pieces if i == last]
                    data = []
                head = encode(Route(MsgType.SNAPSHOT_CHUNK), header.to_wire())[1]
                if not self._post(node, [route, head, *payload]):
                    self._give_up(node, transfer, "it cannot take its snapshot")
                    return
                self.chunks_sent += 1
                # The next chunk is read (in a worker thread) while this one is hashed
                # and the replica makes room.
                reading = read(seq + 1)
                if data:
                    if hashing is not None and not hashing.done():
                        await hashing  # at most two chunks wait for the checksum
                    hashing = asyncio.ensure_future(_fed(hashing, digest, data, buffers))
        finally:
            if hashing is not None and not hashing.done():
                hashing.cancel()
            if reading is not None:  # done before the frozen version is released
                with contextlib.suppress(Exception):
                    await asyncio.shield(reading[1])
        if await self._room(node, transfer, plan.count + self.window - 1):
            self.completed += 1
            log.info(
                "snapshot %d for replica %s delivered in %.2fs (%.0f MB written meanwhile, "
                "copied back as the chunks passed)",
                transfer.snapshot_id,
                node,
                time.monotonic() - t0,
                given_back / 1e6,
            )

    async def _room(self, node: str, transfer: _Transfer, seq: int) -> bool:
        """Wait until chunk ``seq`` may go (fewer than ``window`` unacknowledged)."""
        while seq - transfer.acked > self.window:
            if not self._current(node, transfer):
                return False
            transfer.progress.clear()
            try:
                async with asyncio.timeout(self.timeout):
                    await transfer.progress.wait()
            except TimeoutError:
                self._give_up(
                    node, transfer, f"no snapshot chunk acknowledged for {self.timeout:.0f}s"
                )
                return False
        return self._current(node, transfer)
