"""A replica's side of replication: one subscription to its primary.

It asks the primary for the stream (again every two heartbeat intervals until
a snapshot arrives), loads the snapshot, then applies the stream strictly in
LSN order and acknowledges what it applied.  Invariants: the stream is applied
only on top of a loaded snapshot of this partition at this epoch
(:attr:`ShardSession.synced <zps.shard.session.ShardSession.synced>`); a gap, a
message that does not apply or one that leaves another LSN than the primary's
means a fresh snapshot (:meth:`~zps.shard.session.ShardSession.resync`).

With a write-ahead log (:mod:`zps.shard.durability`), a replica keeps its own:
a loaded snapshot is written as a checkpoint first (the log's base), and every
message applied is logged.  It acknowledges only what its log holds (on disk in
``fsync`` mode), so the primary's ``acks="all"`` counts logged copies.

With shared memory on (:mod:`zps.shm`), a replica on its primary's host says so in
its SUBSCRIBE, and the primary's large stream frames come as descriptors of its
arena: the replica copies them into its own memory before anything is applied.  A
region it cannot read makes it resync (a snapshot, as for a gap); one it can never
read (another host or user) makes it ask for the stream inline from then on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zps import shm, transport
from zps.core.replication import StreamCheck, check_stream
from zps.errors import ProtocolError, ZpsError
from zps.protocol.codec import BufferLike, Message, MsgType, Route, decode, encode
from zps.protocol.messages import (
    Bye,
    Replicate,
    SnapshotAck,
    SnapshotChunk,
    StreamAck,
    Subscribe,
)
from zps.shard.checkpoint import CheckpointStore, Digest, PendingCheckpoint
from zps.shard.core import ShardCore
from zps.shard.durability import Durability
from zps.shard.held import HeldStream, HeldStreamFull
from zps.shard.session import ShardSession
from zps.store import PartitionStore
from zps.store.checksums import READABLE
from zps.store.snapshot import Snapshot, build_store
from zps.store.snapstream import StreamBuilder

#: Stream messages kept in memory while a snapshot arrives and loads; past this they
#: are spooled to disk (zps.shard.held), up to HELD_SPOOL_BYTES.
HELD_MEMORY_BYTES = 64 << 20
HELD_SPOOL_BYTES = 1 << 40
#: The held stream is applied in steps: at most this many bytes read back at a time,
#: and the loop given a turn after at most this long of applying.
DRAIN_BYTES = 8 << 20
DRAIN_STEP_S = 0.02
#: The largest snapshot a replica assembles (as a checkpoint file may be).
MAX_SNAPSHOT_BYTES = 1 << 40
#: A snapshot transfer with no chunk for this long is abandoned and asked for again.
CHUNK_STALL_S = 10.0
#: A refused subscription is asked for again after this long, doubled at each refusal
#: in a row up to the interval between asks (two heartbeats): a replica's SUBSCRIBE
#: can reach a new primary before the broker's map that lists the replica does.
REFUSED_RETRY_S = 0.02

log = logging.getLogger("zps.shard")


class Upstream:
    def __init__(
        self,
        session: ShardSession[Any],
        core: ShardCore,
        channel: transport.Channel,
        *,
        interval: float,
        max_message_bytes: int,
        durability: Durability | None = None,
        checkpoints: CheckpointStore | None = None,
        shared: shm.SharedMemory | None = None,
    ) -> None:
        self.session = session
        self.core = core
        self.channel = channel
        self.interval = interval
        self.max_message_bytes = max_message_bytes
        #: The snapshot being received (chunks arrive in order), when one is: written
        #: into its tables' arrays as it comes, and (with a log) into a checkpoint.
        self._assembly: StreamBuilder | None = None
        self._keeping: PendingCheckpoint | None = None
        self._first_chunk = self._last_chunk = 0.0
        self._abandoned: int | None = None
        #: The load of a snapshot whose chunks are all here (a task beside the stream).
        self._loading: asyncio.Future[None] | None = None
        #: The checksum of the snapshot being received, fed chunk by chunk in a worker
        #: thread beside the chunk's copy.
        self._digest: Digest | None = None
        #: Stream messages that arrived during the snapshot, kept until it is loaded and
        #: applied after it (None: none held, the stream is applied as it comes).
        self._held: HeldStream | None = None
        #: The replica's own log (None or mode "none": no log).
        self._durability = (
            durability if durability is not None and durability.mode != "none" else None
        )
        self._checkpoints = checkpoints if self._durability is not None else None
        #: Large stream frames through the primary's shared memory (None: inline).
        self.shm = shared
        #: Set after each batch of the log is written (see _drain).
        self._log_moved = asyncio.Event()
        #: Refusals in a row, and the ask scheduled after the last one.
        self._refusals = 0
        self._reask: asyncio.TimerHandle | None = None
        self._asking: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Subscribe to the primary, load its snapshot, then apply its stream."""
        self.session.upstream_started()
        if self._durability is not None:
            self._durability.on_durable = self._durable
        try:
            await self._ask()
            await transport.serve(
                self.channel,
                self._handle,
                self._malformed,
                on_burst=self._after_burst,
                idle=self.interval,
                on_idle=self._ask,
            )
        finally:
            if self._reask is not None:
                self._reask.cancel()
            if self._asking is not None:
                self._asking.cancel()
            if self._loading is not None:
                self._loading.cancel()
            self._drop_held()
            if self._durability is not None and self._durability.on_durable == self._durable:
                self._durability.on_durable = None

    def _durable(self) -> None:
        """A batch of the log is on disk: acknowledge what it holds."""
        self._log_moved.set()
        if self.session.synced:
            self.ack_now()

    async def ack(self) -> None:
        self.ack_now()

    def ack_now(self) -> None:
        # Never waits on a primary that stopped reading: a later ack supersedes this one.
        # Only what this replica's log holds is acknowledged (on disk, in fsync mode).
        # Nothing while the stream held during a snapshot is applied: the primary makes
        # writes wait for a copy from its first acknowledgement on (and watches from
        # then on that the copy's acknowledgements keep moving: see _drain).
        if self._held is not None:
            return
        lsn = self.core.lsn
        if self._durability is not None:
            lsn = self._durability.acked_lsn(lsn)
        transport.try_send(
            self.channel,
            encode(
                Route(MsgType.ACK),
                # ``base`` names the snapshot this state grew from: the primary counts
                # acknowledgements of its own stream only, never of another history.
                StreamAck(lsn, self.core.epoch, self.session.base_lsn).to_wire(),
            ),
        )

    async def _ask(self) -> None:
        now = time.monotonic()
        if self._loading is not None:
            if not self._loading.done():
                return  # a snapshot is being loaded: the next step is its own
            loading, self._loading = self._loading, None
            if not loading.cancelled() and loading.exception() is not None:
                raise loading.exception()  # type: ignore[misc]  # a bug: it propagates
        if self._assembly is not None and now - self._last_chunk < CHUNK_STALL_S:
            return  # a snapshot is on its way: asking again would not speed it up
        if self._assembly is not None:
            log.warning("snapshot %d stalled; asking for a new one", self._assembly.snapshot_id)
            self._abandon()
        if self.session.subscribe_due(now):
            host = self.shm.host if self.shm is not None else None
            sub = Subscribe(
                self.session.partition, self.session.epoch, self._abandoned, host, READABLE
            )
            await transport.send(self.channel, encode(Route(MsgType.SUBSCRIBE), sub.to_wire()))
            self.session.subscribe_sent(time.monotonic())

    async def _after_burst(self) -> None:
        if self.session.synced:
            await self.ack()
        await self._ask()

    def _ask_again_soon(self) -> None:
        """Subscribe again after REFUSED_RETRY_S (doubled at each refusal in a row, up
        to the interval between asks), not at the next ask."""
        delay = min(self.interval * 2, REFUSED_RETRY_S * 2**self._refusals)
        self._refusals += 1
        if self._reask is not None:
            self._reask.cancel()
        self._reask = asyncio.get_running_loop().call_later(delay, self._ask_now)

    def _ask_now(self) -> None:
        self._reask = None
        if self.session.synced or self._assembly is not None:
            return
        self.session.resync()  # due at once
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask())

    def _malformed(self, frames: transport.Frames, e: ProtocolError) -> None:
        log.warning("bad message from the primary: %s; resync", e)
        self.session.resync()

    async def _handle(self, frames: transport.Frames) -> None:
        try:
            bufs = [transport.frame_buffer(f) for f in frames]
            msg = decode(bufs)
            if msg.route.mtype is MsgType.REPLICATE and shm.KEY in msg.header:
                read = self._read_shared(bufs, msg)
                if read is None:
                    return
                msg = read
            match msg.route.mtype:
                case MsgType.SNAPSHOT_CHUNK if not self.session.synced:
                    await self._on_chunk(msg.route, msg.header, msg.payloads)
                case MsgType.REPLICATE if self.session.synced and self._held is None:
                    self._apply_stream(msg.route, Replicate.parse(msg.header), msg.payloads)
                case MsgType.REPLICATE:  # ahead of the snapshot, or of the backlog held
                    self._hold(msg.route, Replicate.parse(msg.header), msg.payloads)
                case MsgType.BYE:
                    bye = Bye.parse(msg.header)
                    self.session.refused()
                    log.info("the primary refused the subscription: %s", bye.msg)
                    self._ask_again_soon()
        except ProtocolError:
            raise
        except ZpsError as e:
            raise ProtocolError(str(e)) from e

    def _read_shared(self, bufs: list[Any], msg: Message) -> Message | None:
        """A stream message with its frames copied out of the primary's shared memory;
        None (and a resync) when they cannot be read."""
        try:
            got = (self.shm or shm.OFF).inbound(bufs, msg.header, header_frame=False)
        except shm.ShmUnavailableError as e:
            if e.permanent:
                self.shm = None  # the next SUBSCRIBE asks for every frame inline
            if self.session.synced or self._assembly is not None:  # once per resync
                log.warning("could not read a stream message from shared memory (%s): resync", e)
            if self._assembly is not None:
                self._abandon()
            else:
                self.session.resync()
            return None
        return Message(msg.route, got.header, got.frames[2:])

    def _drop_assembly(self) -> None:
        self._assembly, self._digest = None, None
        if self._keeping is not None:
            keeping, self._keeping = self._keeping, None
            # Closed and removed off the loop: it may be flushing a chunk.
            asyncio.get_running_loop().run_in_executor(None, keeping.abort)

    def _abandon(self) -> None:
        if self._assembly is not None:
            self._abandoned = self._assembly.snapshot_id
        self._drop_assembly()
        self._drop_held()
        self.session.resync()

    def _drop_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            held.close()

    def _hold(self, route: Route, header: Replicate, payloads: Any) -> None:
        """Keep a stream message until the snapshot under way is loaded and what came
        before it applied (in memory, then spooled to disk: zps.shard.held); what the
        snapshot already holds is skipped when the held messages are applied."""
        if self._held is None:
            store = self._checkpoints
            folder = store.root if store is not None and store.root.is_dir() else None
            self._held = HeldStream(HELD_MEMORY_BYTES, HELD_SPOOL_BYTES, folder)
        try:
            self._held.add(route, header, payloads)
        except HeldStreamFull as e:
            log.warning("%s: resync", e)
            self._abandon()

    async def _on_chunk(
        self, route: Route, header: dict[str, Any], payloads: Sequence[BufferLike]
    ) -> None:
        """Take one snapshot chunk; once all are here, load the snapshot and the held stream."""
        try:
            chunk = SnapshotChunk.parse(header)
        except ProtocolError:
            if self._assembly is not None:
                self._abandon()
            raise
        seq, sid = chunk.seq, chunk.id
        if seq == 0 and (self._assembly is None or self._assembly.snapshot_id != sid):
            self._drop_assembly()
            self._first_chunk = time.monotonic()
            self._assembly = StreamBuilder.from_header(header, max_bytes=MAX_SNAPSHOT_BYTES)
            self._digest = Digest(self._assembly.total)
            try:
                self._keeping = self._keep(route, chunk.lsn)
            except OSError as e:
                log.error("could not keep the snapshot at LSN %d as a checkpoint: %s", chunk.lsn, e)
                self._abandon()
                return
        assembly, digest, keeping = self._assembly, self._digest, self._keeping
        if assembly is None or digest is None:  # the rest of a transfer this replica lacks
            if sid != self._abandoned:
                self._abandoned = sid  # the next SUBSCRIBE asks for a new one
                self.session.resync()
            return
        try:
            done = assembly.check(sid, seq, payloads)
        except ProtocolError:
            self._abandon()
            raise
        self._last_chunk = time.monotonic()
        self._refusals = 0
        # The chunk is copied into the tables' arrays, written to the checkpoint and
        # hashed, in three worker threads; acknowledged once all are done, so at most
        # the primary's window of chunks is held here.
        views = [memoryview(p).cast("B") for p in payloads]
        jobs = [asyncio.to_thread(digest.feed, views), asyncio.to_thread(assembly.take, views)]
        if keeping is not None:
            jobs.append(asyncio.to_thread(_write, keeping, views))
        got = await asyncio.gather(*jobs, return_exceptions=True)
        if self._assembly is not assembly:
            return  # replaced or abandoned meanwhile
        for result in got:
            if isinstance(result, ProtocolError | OSError):
                self._abandon()
                raise ProtocolError(f"snapshot {sid} chunk {seq}: {result}")
            if isinstance(result, BaseException):
                raise result
        await transport.send(
            self.channel, encode(Route(MsgType.SNAPSHOT_ACK), SnapshotAck(sid, seq).to_wire())
        )
        if not done:
            return
        # Loaded in a task of its own: this handler returns, so the stream that follows
        # the snapshot is read (and held) meanwhile; a primary drops what a replica
        # leaves unread for seconds, and the gap would cost another snapshot.
        self._loading = asyncio.ensure_future(self._load_assembled(assembly, sid))

    def _keep(self, route: Route, lsn: int) -> PendingCheckpoint | None:
        """With a log, the checkpoint (the log's base) the snapshot is written to as it
        arrives; None without one, or for an empty partition (the log starts from
        nothing), or a snapshot of another partition or epoch (it will not load).
        OSError if it cannot be opened: the transfer is abandoned (and asked for again)."""
        store = self._checkpoints
        if (
            store is None
            or lsn == 0
            or route.epoch != self.core.epoch
            or route.partition != self.core.partition
        ):
            return None
        return store.begin(route.partition, route.epoch, lsn)

    async def _load_assembled(self, assembly: StreamBuilder, sid: int) -> None:
        try:
            await self._finish_snapshot(assembly, sid)
        except ProtocolError as e:
            log.warning("snapshot %d from the primary: %s; resync", sid, e)
            self.session.resync()

    async def _finish_snapshot(self, assembly: StreamBuilder, sid: int) -> None:
        """Every chunk of ``assembly`` is here and taken: check it, then in two worker
        threads at once sync its checkpoint and build its tables (owning the arrays
        the chunks were written into), then load it and apply the stream held
        meanwhile."""
        digest, keeping = self._digest, self._keeping
        began, last = self._first_chunk, time.monotonic()
        if digest is None or not digest.complete or digest.digest() != assembly.digest():
            self._abandon()
            raise ProtocolError(f"snapshot {sid} does not decode: checksum mismatch")
        try:
            snap, store = await asyncio.to_thread(_build, assembly)
        except ZpsError as e:
            if self._assembly is assembly:
                self._abandon()
            raise ProtocolError(f"snapshot {sid} does not load: {e}") from None
        if self._assembly is not assembly:
            return  # replaced while building
        if keeping is not None:
            self._keeping = None
            # The records of the history it replaces go aside first: with the checkpoint
            # committed and them still in the log, a restart would replay them after it.
            durability, kept = self._durability, self._checkpoints
            cut = (
                await durability.cut_after(kept.folder(snap.partition), snap.lsn)
                if durability is not None and kept is not None
                else True
            )
            if not cut:
                await asyncio.to_thread(keeping.abort)  # it may wait for a sync under way
                log.error(
                    "could not keep the snapshot at LSN %d as a checkpoint: the log "
                    "after it could not be set aside",
                    snap.lsn,
                )
                if self._assembly is assembly:
                    self._abandon()
                return
            try:
                await asyncio.to_thread(keeping.commit)
            except OSError as e:
                log.error("could not keep the snapshot at LSN %d as a checkpoint: %s", snap.lsn, e)
                if self._assembly is assembly:
                    self._abandon()
                return
        if self._assembly is not assembly:
            return  # replaced while keeping
        log.info(
            "snapshot %d received: %.0f MB in %.2fs, its tables built and its checkpoint "
            "kept %.2fs after the last chunk",
            sid,
            assembly.total / 1e6,
            last - began,
            time.monotonic() - last,
        )
        self._assembly, self._digest = None, None
        self._abandoned = None
        ok = self._load(snap, store)
        if ok and self._durability is not None and self._checkpoints is not None:
            # The checkpoint just written is the base of this replica's new log.
            self._durability.start(
                self._checkpoints.folder(snap.partition), snap.partition, snap.lsn
            )
        self.session.snapshot_loaded(ok, snap.lsn)
        if ok and keeping is not None:
            self.session.checkpoint_kept(time.monotonic(), snap.lsn)
        if not ok:
            self._drop_held()
            return
        await self._drain()
        if self.session.synced:
            await self.ack()

    async def _drain(self) -> None:
        """Apply the stream held while the snapshot arrived and loaded, in order and in
        steps (the loop gets a turn every DRAIN_STEP_S: heartbeats, the stream's reads);
        what arrives meanwhile joins the end of it.  With a log, no faster than the log
        takes it: a step is applied only once the log holds the step before the previous
        one, and once it is empty the log is waited for, once, until it holds and has
        synced since the last step (what arrives during that wait is then applied
        without another).  The first acknowledgement (after this) then names what the
        log holds, and the next follow at the log's pace: a backlog of unwritten or
        unsynced stream behind it would keep the replica from acknowledging anything new
        for as long as the log takes to write or sync it, and its primary drops a
        replica that acknowledges nothing new for a liveness timeout.  Done once it is
        empty, on the loop, with no await between the last take and going back to
        applying as it comes."""
        # The last step applied, and the one before it: the log holds that one before the
        # next step is applied (one step written while the next is applied).
        last = before = _LogMark(self.core.lsn, 0, False)
        synced_at_end = False
        while self._held is not None and self.session.synced:
            held = self._held
            try:
                batch = await held.take(DRAIN_BYTES)
            except HeldStreamFull as e:
                log.warning("%s: resync", e)
                self._drop_held()
                self.session.resync()
                return
            if self._held is not held:
                return  # dropped meanwhile
            if not batch:
                if not synced_at_end and not self._log_has(last):
                    # Once: what arrives during this wait is applied without another
                    # (every wait lets more arrive: under writes none would be the last).
                    synced_at_end = True
                    await self._log_reaches(last)
                    continue  # what was held meanwhile comes next
                self._held = None
                held.close()
                log.info(
                    "applied the stream held during the snapshot (at most %.0f MB held, "
                    "%.0f MB of it spooled)",
                    held.peak_bytes / 1e6,
                    held.total_spooled_bytes / 1e6,
                )
                return
            await self._log_reaches(before, synced=False)
            if self._held is not held:
                return  # dropped meanwhile
            first = self.core.lsn
            syncs = self._durability.stats.syncs if self._durability is not None else 0
            began = time.monotonic()
            for r, h, p in batch:
                if not self.session.synced or self._held is not held:
                    break
                self._apply_stream(r, h, p)
                if time.monotonic() - began > DRAIN_STEP_S:
                    await asyncio.sleep(0)
                    began = time.monotonic()
            before, last = last, _LogMark(self.core.lsn, syncs, self.core.lsn > first)
            await asyncio.sleep(0)
        self._drop_held()  # a resync meanwhile: the next snapshot's stream is held anew

    def _log_has(self, mark: _LogMark, *, synced: bool = True) -> bool:
        """Whether this replica's log holds ``mark.lsn`` (as its mode requires) and, with
        ``synced`` if ``mark`` wrote to it, has synced since (True without a log)."""
        d = self._durability
        if d is None or d.acked_lsn(mark.lsn) < mark.lsn:
            return d is None
        return not (synced and mark.wrote) or d.stats.syncs > mark.syncs

    async def _log_reaches(self, mark: _LogMark, *, synced: bool = True) -> None:
        """Wait until :meth:`_log_has` ``mark`` (a log that is lost never does: the shard
        then leaves its role, which ends this subscription)."""
        while not self._log_has(mark, synced=synced):
            self._log_moved.clear()
            await self._log_moved.wait()

    def _load(self, snap: Snapshot, store: PartitionStore | None) -> bool:
        if store is None or snap.epoch != self.core.epoch or snap.partition != self.core.partition:
            return False
        self.core.install_snapshot(snap, store)
        log.info("loaded a snapshot of partition %d at LSN %d", snap.partition, snap.lsn)
        return True

    def _apply_stream(self, route: Route, head: Replicate, payloads: Any) -> None:
        prev, lsn = head.prev, head.lsn
        if not payloads:
            raise ProtocolError(f"REPLICATE of LSN {lsn} without the request it carries")
        verdict = check_stream(
            my_epoch=self.core.epoch,
            my_lsn=self.core.lsn,
            epoch=route.epoch,
            prev_lsn=prev,
            lsn=lsn,
        )
        if verdict is StreamCheck.DUPLICATE:
            return
        if verdict is StreamCheck.RESYNC:
            log.warning(
                "replication stream gap (at LSN %d, got %d..%d, epoch %d): resync",
                self.core.lsn,
                prev,
                lsn,
                route.epoch,
            )
            self.session.resync()
            return
        try:
            header = decode([Route(MsgType.REQUEST).pack(), payloads[0]]).header
            got = self.core.apply_replicated(header, payloads[1:], checked=head.checked)
        except (ZpsError, KeyError, ValueError) as e:
            log.error("could not apply LSN %d from the primary: %s; resync", lsn, e)
            self.session.resync()
            return
        if got != lsn:
            log.error("replica diverged: LSN %d after applying, primary had %d; resync", got, lsn)
            self.session.resync()
            return
        if self._durability is not None:
            self._durability.log(route.epoch, prev, lsn, payloads)


@dataclass(frozen=True)
class _LogMark:
    """A step of the held stream applied: the LSN after it, the log's syncs before it,
    and whether it logged anything."""

    lsn: int
    syncs: int
    wrote: bool


def _write(keeping: PendingCheckpoint, views: list[memoryview]) -> None:
    """A chunk into the checkpoint being kept (a worker thread)."""
    for view in views:
        keeping.write(view)


def _build(assembly: StreamBuilder) -> tuple[Snapshot, PartitionStore]:
    """The snapshot and its tables (a worker thread: indexing takes seconds for a GB).
    Dense values on the heap: a worker thread must not take regions of the arena."""
    snap = assembly.snapshot()
    return snap, build_store(snap)
