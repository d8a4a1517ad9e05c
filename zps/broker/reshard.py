"""Live resharding, driven by the active broker (the map's single owner).

``zps-server scale --partitions N`` sets a target; the broker then, one move at a
time (:func:`zps.core.reshard.plan_moves`, at most ``max_slots_per_move`` slots
each):

1. grows the cluster to N partitions first when scaling up (spares become their
   primaries and replicas; too few spares: the command is refused, naming how
   many are missing);
2. records the move (``copying``) in its state record, on disk before anything
   is fenced;
3. marks the slots as importing at the destination and copies their embedding
   rows while the source still serves them (catch-up: ``slots_cut`` with
   ``track``; the source lists every row written from then on);
4. *fences* the slots at the source (``slots_fence``, a record of the source's
   stream: its replicas hold it, and from then on it answers any request on those
   slots ``NOT_PRIMARY``, unapplied, so clients retry), then copies what changed
   since the first copy (``slots_cut`` with ``delta``: the rows written, with their
   optimizer state, every dense chunk and sync-mode gradient on the slots); each
   copy: the source's primary cuts, the broker reads the cut in pieces of at most
   ``piece_bytes`` and hands each to the destination's primary as ``slots_import``,
   a write of its stream (replicated to its replicas, logged, acknowledged by every
   in-sync copy).  A source whose primary changed meanwhile has no list of writes:
   the move is cancelled; one whose table was rebuilt (eviction, a drop) answers
   ``rebuilt``, and the move copies everything again under the fence;
5. records the move as ``copied`` (on disk), gives the slots to the destination in
   the map and publishes it, activates them at the destination, and releases them
   at the source (a record of its stream too);
6. when every move is done, each source drops the released rows
   (``slots_compact``, in steps of ``compact_rows`` rows' worth of work, so it
   serves between them), and the partitions past N go when scaling down (their
   shards become spares).

A request routed by an older map to the source after the cut-over is answered
``MOVED`` and re-split by the client; a message the source applied before the
fence and re-sent is answered from its dedup record (looked up first).  Sync
commits wait while a move is under way, so a step is applied exactly once, at the
source before the fence or at the destination after the cut-over.

Failures: a request of the move that fails (the source or destination failed
over, a timeout) cancels the move (the source unfences, the destination drops
what it imported) and the plan starts again from the current map.  A broker that
takes over (restart, pair failover) finds the move in its state record: one
``copying`` is cancelled, one ``copied`` is completed (the destination held every
slot before the record said so).  ``zps-server scale --cancel`` cancels the move
under way and drops the target.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from zps.broker.acceptance import MOVE_TARGET, MoveReply
from zps.broker.reshardhost import ReshardHost
from zps.broker.reshardstats import MoveFailed, ReshardStats, StandbyAway, Superseded
from zps.core.brokerstate import ReshardRecord
from zps.core.reshard import DEFAULT_MAX_SLOTS_PER_MOVE, needed, plan_moves, plan_pieces
from zps.protocol.codec import BufferLike, MsgType, Route, encode

log = logging.getLogger("zps.broker.reshard")

#: Pieces of a move's copy under way at once (read from the source, imported at the
#: destination): reading the next overlaps importing this one, and the destination finds
#: the next piece waiting when it is done with one (at most ``PIPELINE * piece_bytes``
#: held by the broker at once; figures: docs/performance.md, "Live resharding").
PIPELINE = 6
#: Rows' worth of work per step of a drop of released rows (``slots_compact``): a few
#: tens of milliseconds of a shard's event loop.
COMPACT_ROWS = 131072
#: Answers that mean "the partition is between primaries, or busy": the same request
#: (same sequence number: the shard's dedup record keeps it exactly once) again.
_RETRY = frozenset({"NOT_PRIMARY", "STALE_EPOCH", "OVERLOADED", "NOT_ENOUGH_REPLICAS"})


def _nop(what: str) -> None:
    pass


class Resharder:
    """The broker's live resharding (see the module notes)."""

    def __init__(
        self,
        host: ReshardHost,
        *,
        durable: bool,
        heartbeat_interval: float,
        liveness: int,
        max_slots_per_move: int = DEFAULT_MAX_SLOTS_PER_MOVE,
        piece_bytes: int = 8 << 20,
        request_timeout: float = 30.0,
        compact_rows: int = COMPACT_ROWS,
        catchup: bool = True,
    ) -> None:
        self.host = host
        #: Whether the slot map survives this broker (a data dir, or a pair's standby).
        self.durable = durable
        self.heartbeat_interval = heartbeat_interval
        self.liveness = liveness
        #: Copy a move's slots before fencing them, then only what changed meanwhile.
        self.catchup = catchup
        self.compact_rows = compact_rows
        self.max_slots = max_slots_per_move
        self.piece_bytes = piece_bytes
        self.request_timeout = request_timeout
        self.record: ReshardRecord | None = None
        self.stats = ReshardStats()
        self.cid = b"\x00mv-" + uuid.uuid4().hex[:16].encode()
        self._seqs = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future[MoveReply]] = {}
        self._wake = asyncio.Event()
        self._cancel = False
        #: Bumped by :meth:`restore`: a step begun under an older state stops (Superseded).
        self._gen = 0
        self._progress: dict[str, Any] = {}
        #: No move fences its slots before then (monotonic): see :meth:`_breathe`.
        self._fence_after = 0.0

    # -- commands --------------------------------------------------------------

    def restore(self, rec: ReshardRecord | None) -> None:
        """A recorded resharding (broker start or takeover): resumed once routing."""
        self.record = rec
        self.cid = b"\x00mv-" + uuid.uuid4().hex[:16].encode()
        self._gen += 1
        for fut in self._futures.values():
            if not fut.done():
                fut.cancel()
        if rec is not None:
            self._wake.set()

    def request(
        self, target: int, now: float, *, max_slots: int = 0, piece_bytes: int = 0
    ) -> dict[str, Any]:
        """``zps-server scale --partitions target``: the answer for the operator
        (``max_slots``: slots per move, ``piece_bytes``: bytes per copied piece; 0 keeps
        the current settings)."""
        state = self.host.state
        if target < 1 or target > state.n_slots:
            return {"ok": False, "msg": f"--partitions must be 1..{state.n_slots}"}
        if not self.durable:
            return {
                "ok": False,
                "msg": "this broker has no data dir: the slot map would not survive its "
                "restart (start it with --data-dir to scale)",
            }
        if state.holding(now):
            return {"ok": False, "msg": "the broker is collecting the shards' claims; ask again"}
        if self.record is not None and self.record.target != target:
            return {
                "ok": False,
                "msg": f"scaling to {self.record.target} partitions is under way; "
                "cancel it first (zps-server scale --cancel)",
            }
        if self.record is not None:
            # The same command again: the scaling under way goes on (its record, with
            # the move in flight, stays: replacing it would leave that move's fence).
            return {"ok": True, "msg": f"scaling to {target} partitions is under way"}
        missing = [p for p in range(state.n_partitions) if state.primary_of(p) is None]
        if missing:
            return {"ok": False, "msg": f"partitions {missing} have no primary; scale later"}
        if target > state.n_partitions:
            need = target - state.n_partitions
            spares = state.spare_count()
            if spares < need:
                return {
                    "ok": False,
                    "msg": f"scaling from {state.n_partitions} to {target} partitions needs "
                    f"{need} spare shards for the new partitions' primaries "
                    f"({need * state.replication} with replicas); {spares} registered: start "
                    f"{need - spares} more shard(s) first",
                }
        old = state.n_partitions
        self.max_slots = max_slots or self.max_slots
        self.piece_bytes = max(4096, piece_bytes) if piece_bytes else self.piece_bytes
        moves = plan_moves(
            state.slot_map, target, old_partitions=old, max_slots_per_move=self.max_slots
        )
        self.record = ReshardRecord(target)
        self._cancel = False
        self.stats.last_error = ""
        self.host.state_changed()
        self._wake.set()
        log.warning(
            "scaling from %d to %d partitions: %d slots to move in %d moves",
            old,
            target,
            moves.moved_slots,
            len(moves.moves),
        )
        return {
            "ok": True,
            "msg": f"scaling from {old} to {target} partitions: {moves.moved_slots} slots "
            f"in {len(moves.moves)} moves",
        }

    def cancel(self) -> dict[str, Any]:
        """``zps-server scale --cancel``: undo the move under way, drop the target."""
        if self.record is None:
            return {"ok": False, "msg": "no resharding is under way"}
        if self.record.stage == "copied":
            return {
                "ok": False,
                "msg": "the move under way is being published (its copy is complete); "
                "it cannot be cancelled: scale back afterwards",
            }
        self._cancel = True
        self._wake.set()
        for fut in self._futures.values():
            if not fut.done():
                fut.cancel()
        return {"ok": True, "msg": "cancelling: the source unfences, the destination drops"}

    def status(self) -> dict[str, Any] | None:
        rec = self.record
        s = self.stats
        out: dict[str, Any] = {
            "target": rec.target if rec else None,
            "moves_done": s.moves_done,
            "moves_cancelled": s.moves_cancelled,
            "slots_moved": s.slots_moved,
            "bytes_moved": s.bytes_moved,
            "max_fenced_s": round(s.max_fenced_s, 3),
            "compact_steps": s.compact_steps,
            "fenced_rows": s.fenced_rows,
            "last_move_s": round(s.last_move_s, 3),
            "last_error": s.last_error,
        }
        if rec is not None and rec.stage:
            out["move"] = {
                "source": rec.source,
                "dest": rec.dest,
                "slots": len(rec.slots),
                "stage": rec.stage,
                **self._progress,
            }
        return out

    def on_reply(self, reply: MoveReply) -> None:
        fut = self._futures.get(reply.route.req_id)
        if (
            fut is not None
            and not fut.done()
            and self.host.state.primary_of(reply.route.partition) == reply.node
        ):
            fut.set_result(reply)

    # -- the driver ------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.record is not None:
                if not self._routing():
                    await asyncio.sleep(0.2)
                    continue
                try:
                    try:
                        await self._step()
                    except Superseded:
                        raise
                    except StandbyAway as e:
                        if self.stats.last_error != str(e):
                            log.warning("live resharding waits: %s", e)
                        self.stats.last_error = str(e)
                        await asyncio.sleep(1.0)
                    except asyncio.CancelledError:
                        if not self._cancel:
                            raise
                        await self._failed("cancelled by an operator")
                    except MoveFailed as e:
                        await self._failed(str(e))
                    except Exception as e:
                        # A bug, or an answer it cannot read: never the broker's end.
                        log.exception("slot move failed")
                        await self._failed(f"{type(e).__name__}: {e}")
                except Superseded:
                    log.info("the slot move under way was left: this broker's state was replaced")

    def _routing(self) -> bool:
        return self.host.routing()

    async def _failed(self, why: str) -> None:
        try:
            await self._give_up(why)
        finally:
            # A sync commit held back by the move goes out now (after the undo).
            self.host.training.paused = False
            await self.host.training.advance()

    async def _give_up(self, why: str) -> None:
        rec = self.record
        if rec is None:  # this broker stood down meanwhile (a pair): the other one drives
            return
        if rec.stage == "copied":
            # The destination holds every slot: the move is completed, never undone
            # (the map giving it the slots may be out already).
            log.warning("completing the slot move %d -> %d: %s", rec.source, rec.dest, why)
            self._cancel = False
            await asyncio.sleep(0.2)
            return
        if not self._cancel:
            log.error("slot move %d -> %d failed: %s; cancelling it", rec.source, rec.dest, why)
            self.stats.last_error = why
        try:
            await self._undo(rec)
        except MoveFailed as e:
            log.error("cancelling the slot move failed: %s; trying again", e)
            self.stats.last_error = str(e)
            await asyncio.sleep(1.0)
            return
        if self._cancel:
            log.warning("resharding to %d partitions cancelled by an operator", rec.target)
            self._cancel = False
            self._set(None)
            state = self.host.state
            # Partitions added for the target that got no slot yet go again.
            holding = int(state.slot_map.max()) + 1
            if holding < state.n_partitions:
                before = state.map_version
                await self.host.apply(state.shrink(holding))
                await self.host.publish_if_changed(before)
            await self._persisted()
            try:
                await self._compact(range(self.host.state.n_partitions))
            except MoveFailed as e:
                log.error("dropping the rows of released slots failed: %s", e)
            return
        await asyncio.sleep(1.0)

    async def _step(self) -> None:
        rec = self.record
        assert rec is not None
        if self._cancel:
            raise MoveFailed("cancelled by an operator")
        if rec.stage == "copied":
            await self._finish(rec)
            return
        if rec.stage == "copying":  # a broker that took over: nobody is copying
            await self._undo(rec)
            return
        state = self.host.state
        if state.n_partitions < rec.target:
            before = state.map_version
            await self.host.apply(state.grow(rec.target, time.monotonic()))
            self.host.state_changed()
            await self.host.publish_if_changed(before)
        if any(
            state.primary_of(p) is None
            for p in needed(state.slot_map, state.n_partitions, rec.target)
        ):
            await asyncio.sleep(0.2)
            return
        plan = plan_moves(
            state.slot_map,
            rec.target,
            old_partitions=state.n_partitions,
            max_slots_per_move=self.max_slots,
        )
        if not plan.moves:
            await self._compact(range(min(state.n_partitions, rec.target)))
            if state.n_partitions > rec.target:
                # The emptied partitions stay in the map a little longer: a request
                # still in flight to one (parked by a fence) is answered MOVED there
                # and re-split, instead of failing for want of a partition.
                await asyncio.sleep(max(1.0, 2 * self.heartbeat_interval * self.liveness))
                before = state.map_version
                await self.host.apply(state.shrink(rec.target))
                await self.host.publish_if_changed(before)
            log.warning("resharding done: %d partitions", state.n_partitions)
            self._set(None)
            await self._persisted()
            return
        refused = await self._move(plan.moves[0].source, plan.moves[0].dest, plan.moves[0].slots)
        if refused:
            # A breath between moves, longer than a client's retry backoff (its
            # heartbeat interval): a message refused during this move's fence is served
            # before the next fence, instead of finding slots of the next move fenced in
            # turn.  The next move's unfenced copy refuses nothing: it goes on
            # meanwhile, and only its fence waits.  Nothing refused: nothing to wait for.
            self._fence_after = time.monotonic() + 1.5 * self.heartbeat_interval

    async def _breathe(self) -> bool:
        """Wait until a fence may be taken (the breath after a move that refused a
        request); whether it waited."""
        wait = self._fence_after - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        return wait > 0

    async def _compact(self, partitions: range) -> None:
        """Each source drops the rows of the slots it released (once, at the end: a
        drop rewrites the partition's id index), in steps of ``compact_rows`` rows'
        worth of work, so the shard serves (and heartbeats) between them; then one
        ``slots_compact`` without a bound, which leaves every copy of the partition
        without those rows (nothing left to do on one that followed the steps)."""
        for p in partitions:
            t0 = time.monotonic()
            dropped = steps = 0
            while True:
                res, _ = await self._call(p, [{"op": "slots_compact", "rows": self.compact_rows}])
                steps += 1
                dropped += int(res.get("dropped", 0))
                if res.get("done", True):
                    break
            res, _ = await self._call(p, [{"op": "slots_compact"}], timeout=600.0)
            dropped += int(res.get("dropped", 0))
            self.stats.compact_steps += steps
            if dropped:
                log.info(
                    "partition %d dropped %d rows of the slots it gave away in %.2fs (%d steps)",
                    p,
                    dropped,
                    time.monotonic() - t0,
                    steps,
                )

    def _set(self, rec: ReshardRecord | None) -> None:
        self.record = rec
        self.host.state_changed()

    async def _persisted(self) -> None:
        """Wait until the state as it is now survives this broker (its data dir, its
        standby unless the peer is silent)."""
        await self.host.persisted()

    async def _in_standby(self) -> bool:
        """Wait until the state as it is now is in this broker's data dir and in its
        standby's record, even a silent one: a peer cut off from this broker and from
        the clients takes over with what it holds.  False: it does not hold it yet."""
        return await self.host.persisted(standby=True)

    def _lost(self, p: int) -> bool:
        """Partition ``p`` is lost while the move under way can still be cancelled."""
        state, rec = self.host.state, self.record
        return (
            p < state.n_partitions
            and state.is_lost(p)
            and rec is not None
            and rec.stage == "copying"
        )

    def _owned(self, p: int) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.host.state.slot_map == p)]

    def _common(self, p: int, slots: Sequence[int]) -> dict[str, Any]:
        state = self.host.state
        return {
            "slots": list(slots),
            "n_slots": state.n_slots,
            "owned": self._owned(p),
            "version": state.map_version,
        }

    async def _move(self, source: int, dest: int, slots: tuple[int, ...]) -> bool:
        """Move ``slots`` from ``source`` to ``dest``; whether a request was refused
        meanwhile (or may have been: a copy changed)."""
        rec = self.record
        assert rec is not None
        t0 = time.monotonic()
        self._progress = {"bytes": 0, "started": round(time.time(), 3)}
        self._set(replace(rec, source=source, dest=dest, slots=slots, stage="copying"))
        marks = [("start", t0)]

        def mark(what: str) -> None:
            marks.append((what, time.monotonic()))

        # Before the fence: a broker taking over must know it (else the fence would stay).
        if not await self._in_standby():
            cur = self.record
            if cur is not None:
                self._set(replace(cur, source=-1, dest=-1, slots=(), stage=""))
            await self._persisted()
            raise StandbyAway(
                "the standby broker of the pair does not hold the next move's record "
                "(silent or behind): no move starts until it does"
            )
        mark("recorded")
        training = self.host.training
        training.paused = True
        try:
            while training.commit_in_flight:
                await asyncio.sleep(0.01)
            begun, _ = await self._call(dest, [{"op": "slots_import", **self._common(dest, slots)}])
            dest_epoch = self.host.state.map.partitions[dest].epoch
            mark("import_begun")
            moved = 0
            if self.catchup:
                # Catch-up: the rows as they are now, while the source serves them; it
                # lists the rows written from then on (a source failover loses the
                # list, and the move is cancelled at the fenced cut below).
                track = {"op": "slots_cut", **self._common(source, slots), "track": True}
                got = await self._copy(source, dest, slots, track, fresh=True, mark=mark)
                assert got is not None
                moved += got[0]
                mark("copied_unfenced")
            fence = {"op": "slots_fence", **self._common(source, slots)}
            if await self._breathe():
                mark("breathed")
            fenced_res, _ = await self._call(source, [fence])
            fence_epoch = self.host.state.map.partitions[source].epoch
            t_fence = time.monotonic()
            mark("fenced")
            self._progress["fenced_at"] = round(time.time(), 3)
            got = None
            fresh = not self.catchup
            if self.catchup:
                delta = {"op": "slots_cut", "slots": list(slots), "delta": True}
                got = await self._copy(source, dest, slots, delta, mark=mark)
                if got is None:  # a table was rebuilt meanwhile: copy everything again
                    log.warning("slot move %d -> %d: copying the slots again", source, dest)
                    common = self._common(dest, slots)
                    await self._call(dest, [{"op": "slots_drop_import", **common}])
                    await self._call(dest, [{"op": "slots_import", **common}])
                    fresh = True
            if got is None:  # fence, then copy everything
                full = {"op": "slots_cut", "slots": list(slots)}
                got = await self._copy(source, dest, slots, full, fresh=fresh)
            assert got is not None
            moved += got[0]
            fenced_rows = got[1]
            if self.host.state.map.partitions[source].epoch != fence_epoch:
                # The source failed over during the copy: its new primary must have held
                # the fence all along (a replica that joined by snapshot during the move
                # learnt its slots from the map, and may have taken writes on them).
                res, _ = await self._call(source, [fence])
                if not res.get("held"):
                    raise MoveFailed("the source's new primary did not hold the fence")
            mark("copied")
            rec = self.record
            assert rec is not None
            copied = replace(rec, stage="copied")
            self._set(copied)
            # Past this the move is completed, never undone: a broker taking over must
            # hold "copied" (with "copying" it would drop the destination's import).
            # Until the standby holds it the move waits, fenced, neither undone nor
            # completed: the broker that ends up active decides by its own record.
            gen = self._gen
            while not await self._in_standby():
                if gen != self._gen:
                    raise Superseded()
                log.warning("slot move %d -> %d waits for the standby broker", source, dest)
            mark("recorded_copied")
            after = await self._finish(copied, mark)
        finally:
            training.paused = False
        # Whether a request was refused while the slots moved (fenced at the source,
        # importing at the destination), as the copies that answered counted it (a
        # copy that took over meanwhile counted from its start).
        parts = self.host.state.map.partitions
        counts = (
            begun.get("refused"),
            after.get("dest_refused"),
            fenced_res.get("refused"),
            after.get("source_refused"),
        )
        refused = (
            parts[source].epoch != fence_epoch
            or parts[dest].epoch != dest_epoch
            or any(type(c) is not int for c in counts)
            or counts[0] != counts[1]
            or counts[2] != counts[3]
        )
        # Fenced: from the fence until the destination serves the slots.
        fenced = dict(marks)["activated"] - t_fence
        took = time.monotonic() - t0
        s = self.stats
        s.moves_done += 1
        s.slots_moved += len(slots)
        s.bytes_moved += moved
        s.max_fenced_s = max(s.max_fenced_s, fenced)
        s.last_move_s = took
        s.fenced_rows = fenced_rows
        s.history.append(
            {
                "source": source,
                "dest": dest,
                "slots": len(slots),
                "bytes": moved,
                "seconds": round(took, 3),
                "fenced_s": round(fenced, 3),
                "fenced_rows": fenced_rows,
            }
        )
        del s.history[:-64]
        log.info(
            "moved %d slots (%d bytes) from partition %d to %d in %.2fs (fenced %.2fs, "
            "%d rows copied fenced): %s",
            len(slots),
            moved,
            source,
            dest,
            took,
            fenced,
            fenced_rows,
            " ".join(f"{w} {t - marks[i][1]:.3f}" for i, (w, t) in enumerate(marks[1:])),
        )
        await training.advance()
        return refused

    async def _copy(
        self,
        source: int,
        dest: int,
        slots: tuple[int, ...],
        cut: dict[str, Any],
        *,
        fresh: bool = False,
        mark: Callable[[str], None] = _nop,
    ) -> tuple[int, int] | None:
        """Take the source's cut (``cut``, a ``slots_cut``), read it in pieces and import
        each at the destination, up to ``PIPELINE`` pieces under way at once (pieces are
        distinct rows or chunks: the order they land in does not matter).  The bytes and
        the embedding rows copied; None if the source answered ``rebuilt``.  ``fresh``:
        the first copy since the import's first record (its pieces' ids are distinct,
        and absent there unless the destination held rows on the slots, which it
        checks)."""
        common = self._common(dest, slots)
        if fresh:
            common["fresh"] = True
        manifest, _ = await self._call(source, [cut])
        mark("cut_fenced" if cut.get("delta") else "cut_unfenced")
        if manifest.get("rebuilt"):
            return None
        reads = plan_pieces(manifest, common, self.piece_bytes)
        moved = landed = 0
        window = asyncio.Semaphore(PIPELINE)

        async def piece(read: dict[str, Any], base: dict[str, Any]) -> None:
            nonlocal moved, landed
            async with window:
                res, payloads = await self._call(source, [read])
                await self._call(dest, [{**base, "a": res["a"]}], payloads)
            moved += sum(len(p) for p in payloads)
            landed += 1
            self._progress["bytes"] = moved

        try:
            async with asyncio.TaskGroup() as tg:
                for read, base in reads:
                    tg.create_task(piece(read, base))
        except* MoveFailed as group_error:
            raise MoveFailed(str(group_error.exceptions[0])) from None
        if self._cancel or landed != len(reads):
            raise MoveFailed(f"the copy stopped after {landed} of {len(reads)} pieces")
        if manifest.get("steps") or manifest.get("committed", -1) >= 0:
            res, payloads = await self._call(source, [{"op": "slots_cut_read", "steps": True}])
            op = {
                "op": "slots_import",
                **common,
                "steps": True,
                "a": res["a"],
                "committed": manifest.get("committed", -1),
            }
            await self._call(dest, [op], payloads)
        return moved, int(manifest.get("rows", 0))

    async def _finish(
        self, rec: ReshardRecord, mark: Callable[[str], None] = _nop
    ) -> dict[str, Any]:
        """The copy is complete (recorded): publish, activate, release.  The requests
        the destination and the source had refused (``dest_refused``,
        ``source_refused``), as they answered."""
        state = self.host.state
        slots = list(rec.slots)
        if rec.dest >= state.n_partitions:
            raise MoveFailed(f"partition {rec.dest} is gone")
        if bool((state.slot_map[np.asarray(slots, dtype=np.int64)] != rec.dest).any()):
            before = state.map_version
            state.move_slots(slots, rec.dest)
            self.host.state_changed()
            await self._persisted()
            mark("map_recorded")
            await self.host.publish_if_changed(before)
        activate = {"op": "slots_activate", **self._common(rec.dest, slots)}
        res, _ = await self._call(rec.dest, [activate])
        out = {"dest_refused": res.get("refused")}
        mark("activated")
        if rec.source < state.n_partitions:
            release = {"op": "slots_release", **self._common(rec.source, slots), "drop": False}
            res, _ = await self._call(rec.source, [release])
            out["source_refused"] = res.get("refused")
            mark("released")
        cur = self.record
        if cur is not None:
            self._set(replace(cur, source=-1, dest=-1, slots=(), stage=""))
        self._progress = {}
        return out

    async def _undo(self, rec: ReshardRecord) -> None:
        """Cancel the move of ``rec``: the source unfences, the destination drops."""
        state = self.host.state
        slots = list(rec.slots)
        if slots and 0 <= rec.source < state.n_partitions:
            await self._call(
                rec.source, [{"op": "slots_unfence", **self._common(rec.source, slots)}]
            )
            # The source serves the slots again: what is left (the destination's drop,
            # which waits if it is lost) is retried without it.
            cur = self.record
            if cur is not None and cur.stage == "copying":
                self._set(replace(cur, source=-1))
        if slots and 0 <= rec.dest < state.n_partitions:
            await self._call(
                rec.dest, [{"op": "slots_drop_import", **self._common(rec.dest, slots)}]
            )
        if slots:
            self.stats.moves_cancelled += 1
            log.warning(
                "slot move of %d slots from %d to %d cancelled", len(slots), rec.source, rec.dest
            )
        cur = self.record
        if cur is not None:
            self._set(replace(cur, source=-1, dest=-1, slots=(), stage=""))
        self._progress = {}
        await self._persisted()

    async def _call(
        self,
        p: int,
        ops: list[dict[str, Any]],
        payloads: Sequence[BufferLike] = (),
        *,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], list[BufferLike]]:
        """One request to partition ``p``'s primary, re-sent (same sequence number)
        until it is answered; the first operation's result and the reply's arrays."""
        gen = self._gen
        header = {"cid": self.cid, "seq": next(self._seqs), "ops": ops}
        state = self.host.state
        limit = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        backoff = 0.02
        what = f"{ops[0]['op']} on partition {p}"
        last = "no answer"
        while True:
            if gen != self._gen:
                raise Superseded()
            if time.monotonic() > deadline:
                raise MoveFailed(f"{what}: {last} after {limit:g}s")
            primary = state.primary_of(p) if p < state.n_partitions else None
            if primary is None and self._lost(p):
                # No copy holding its data is live (it may stay so until an operator
                # resets it): a move not yet copied is cancelled at once, so the
                # source does not hold its fence for the request timeout.
                raise MoveFailed(f"{what}: partition {p} is lost")
            if primary is None or not self._routing():
                await asyncio.sleep(0.1)
                continue
            epoch = state.map.partitions[p].epoch
            req_id = next(self._req_ids)
            fut: asyncio.Future[MoveReply] = asyncio.get_running_loop().create_future()
            self._futures[req_id] = fut
            route = Route(MsgType.REQUEST, p, epoch, req_id)
            self.host.post([primary.encode(), MOVE_TARGET, *encode(route, header), *payloads])
            try:
                async with asyncio.timeout(min(5.0 if timeout is None else limit, limit)):
                    reply = await fut
            except TimeoutError:
                continue
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or not task.cancelling():
                    if gen != self._gen:
                        raise Superseded() from None
                    if self._cancel:
                        raise MoveFailed("cancelled by an operator") from None
                raise
            finally:
                self._futures.pop(req_id, None)
            st = reply.header.get("st")
            log.debug("%s: %s %s", what, st, reply.header.get("msg", ""))
            if st in _RETRY:
                last = f"{st} {reply.header.get('msg', '')}"
                await asyncio.sleep(backoff)
                backoff = min(0.5, backoff * 2)
                continue
            res = reply.header.get("res")
            first = res[0] if isinstance(res, list) and res else None
            if st != "OK" or not isinstance(first, dict) or first.get("st") != "OK":
                detail = first if isinstance(first, dict) else reply.header
                raise MoveFailed(f"{what}: {detail.get('st')} {detail.get('msg', '')}")
            return first, list(reply.payloads)
