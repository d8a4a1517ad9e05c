"""The broker's state that survives a restart: its record, and what waits for it.

One job: build the state record (:class:`~zps.core.brokerstate.BrokerState`: partitions,
epochs, LSN floors, the slot map, training, shard keys), restore one at start, have the
data dir's writer (:class:`~zps.broker.statefile.StateWriter`) write it when it changed,
and send the messages that must wait until the state as it is now is durable
(:meth:`Record.send_durable`): maps, a promoted primary's lease echoes, the
training's commits.  Without a data dir nothing waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from zps.broker.statefile import StateFile, StateWriter
from zps.broker.training import Training
from zps.core.brokerstate import BrokerState
from zps.core.cluster import ClusterState
from zps.core.membership import FailureDetector, is_liveness
from zps.core.routing import default_slot_map
from zps.errors import ConfigError
from zps.ops.config import BrokerConfig
from zps.protocol.codec import MsgType, Route, encode

log = logging.getLogger("zps.broker")


class PairView(Protocol):
    """What the record needs of the broker pair (:class:`~zps.broker.pair.Pair`)."""

    @property
    def active(self) -> bool: ...

    @property
    def term(self) -> int: ...

    @property
    def record_term(self) -> int: ...

    def mirrored(self) -> BrokerState | None: ...

    def after_held(self, callback: Callable[[], object]) -> None: ...

    def peer_holds_now(self) -> bool: ...

    def peer_alive(self, now: float) -> bool: ...


class ReshardRecord(Protocol):
    """What the record needs of the resharding (:class:`~zps.broker.reshard.Resharder`)."""

    @property
    def record(self) -> Any: ...

    def restore(self, record: Any) -> None: ...


class Record:
    """The state record and durable sends (see the module notes).

    ``state`` and ``training`` are the broker's current ones (a broker of a pair gets
    new ones when it resets); ``bound_keys`` (shard name -> CURVE key) is shared with
    the admission; ``resized(now)`` is called when a recorded slot map changed the
    partition count; ``pair`` is set once the pair exists."""

    def __init__(
        self,
        config: BrokerConfig,
        state: ClusterState,
        training: Training,
        reshard: ReshardRecord,
        bound_keys: dict[str, bytes],
        *,
        send: Callable[[list[Any]], Awaitable[bool]],
        post: Callable[[list[Any]], object],
        resized: Callable[[float], None],
    ) -> None:
        self.config = config
        self.state = state
        self.training = training
        self.reshard = reshard
        self.bound_keys = bound_keys
        self._send = send
        self._post = post
        self._resized = resized
        self.pair: PairView | None = None
        self.writer: StateWriter | None = None
        #: The newest state record produced.
        self.last: BrokerState | None = None
        #: Without a data dir, in a pair: each partition's newest confirmed epoch the
        #: standby is known to hold (see :meth:`epoch_unrecorded`).
        self._held_floor: dict[int, int] = {}

    def state_record(self) -> BrokerState:
        """The broker's state as one record: the one place it is built (for the state
        file, and for anything that mirrors this broker).  The version grows only
        when the content changed.  A standby of a pair records its active peer's
        state (the last record received), so either broker restarts knowing it."""
        last = self.last
        version = (last.version if last else 0) + 1
        mirrored = self.pair.mirrored() if self.pair is not None else None
        if mirrored is not None:
            rec = replace(mirrored, version=version)
        else:
            clocks, jobs = self.training.records()
            rec = BrokerState(
                version=version,
                n_partitions=self.state.n_partitions,
                n_slots=self.state.n_slots,
                replication=self.state.replication,
                map_version=self.state.map_version,
                partitions=self.state.records(),
                clocks=clocks,
                jobs=jobs,
                **self.reshard_record(),
                shard_keys=tuple(sorted((n, k.decode()) for n, k in self.bound_keys.items())),
                term=self.pair.record_term if self.pair is not None else 0,
            )
        if last is not None and rec.same_content(last):
            return last
        self.last = rec
        return rec

    def reshard_record(self) -> dict[str, Any]:
        """The slot map (when not round-robin over the configured partitions) and the
        resharding under way and the epochs of partitions removed, for the state record."""
        state = self.state
        default = state.n_partitions == self.config.partitions and bool(
            (state.slot_map == default_slot_map(state.n_slots, state.n_partitions)).all()
        )
        return {
            "slot_map": b"" if default else state.slot_map.astype("<i4").tobytes(),
            "reshard": self.reshard.record,
            "retired": tuple(sorted(state.retired_epochs.items())),
        }

    def restore_slots(self, rec: BrokerState) -> None:
        """A recorded slot map (it brings its partition count) and resharding."""
        if rec.slot_map:
            slot_map = np.frombuffer(rec.slot_map, dtype="<i4").astype(np.int32)
            self.state.restore(rec.map_version, rec.partitions, slot_map, rec.retired)
            self._resized(time.monotonic())
        else:
            self.state.restore(rec.map_version, rec.partitions, retired=rec.retired)
        self.reshard.restore(rec.reshard)

    def pair_record(self, version: int) -> BrokerState:
        """The state as the active broker of a pair streams it to its standby
        (partitions, map version, slot map, training), as ``version``."""
        state, training = self.state, self.training
        return BrokerState(
            version=version,
            n_partitions=state.n_partitions,
            n_slots=state.n_slots,
            replication=state.replication,
            map_version=state.map_version,
            partitions=state.records(),
            clocks=training.clocks.to_record(),
            jobs=tuple(job.to_record() for job in training.jobs.values()),
            **self.reshard_record(),
            term=self.pair.record_term if self.pair is not None else 0,
        )

    def load_record(self, rec: BrokerState) -> None:
        """Take over a pair's record (on a fresh state, before any shard registers)."""
        self.restore_slots(rec)
        # A sync commit under way is sent again once the primaries are back (the shards
        # answer a repeated commit from their dedup record).
        self.training.restore(rec.clocks, rec.jobs)

    async def persisted(self, *, standby: bool = False) -> bool:
        """Wait until the state record as it is now is in the data dir (at once without
        one) and, in a pair, in the standby's copy (it takes over with it), unless the
        peer is gone: a dead peer takes nothing over (it stands by when it comes back,
        and is sent the state then), and waiting for it would hold the caller.
        ``standby``: a peer that is silent is not taken for gone (a peer cut off from
        this broker and from the clients takes over, with the record it holds): wait
        for it to hold the record, at most 4 x ``peer_timeout``; returns whether it
        does (always True without a pair)."""
        writer = self.writer
        if writer is not None:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def written() -> None:
                if not done.done():
                    done.set_result(None)

            writer.after_write(written)
            await done
        pair = self.pair
        if pair is not None and pair.active:
            deadline = time.monotonic() + 4 * self.config.peer_timeout
            while (
                not pair.peer_holds_now()
                and (standby or pair.peer_alive(time.monotonic()))
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.01)
            return not standby or pair.peer_holds_now()
        return True

    def apply_state(self, rec: BrokerState, detector: FailureDetector) -> None:
        """Take over a recorded state (at start, before any node is known); the
        recorded workers are watched by ``detector``."""
        if rec.slot_map and rec.n_slots == self.config.slots:
            pass  # resharded: the record's partition count stands
        elif (rec.n_partitions, rec.n_slots) != (self.config.partitions, self.config.slots):
            raise ConfigError(
                f"the broker state (version {rec.version}) is of a cluster of "
                f"{rec.n_partitions} partitions and {rec.n_slots} slots; this broker was "
                f"given {self.config.partitions} partitions and {self.config.slots} slots"
            )
        self.restore_slots(rec)
        self.training.restore(rec.clocks, rec.jobs)
        self.bound_keys.clear()
        self.bound_keys.update((node, key.encode()) for node, key in rec.shard_keys)
        self.last = rec
        # The recorded workers are watched like any peer: one that never speaks to
        # this broker is declared dead (its tasks re-queued, its clock dropped).
        now = time.monotonic()
        for worker in {w for w, _, _ in rec.clocks.workers} | {
            w for job in rec.jobs for _, w in job.held
        }:
            detector.seen(worker, now)

    def load(self, file: StateFile, detector: FailureDetector) -> None:
        """Restore the state from the data dir's file (if any) and write it there from
        now on."""
        file.prepare()
        rec = file.load()
        if rec is None:
            log.info("no broker state in %s yet: a new cluster", file.dir)
        else:
            self.apply_state(rec, detector)
            known = [p for p, r in enumerate(rec.partitions) if r.known]
            log.info(
                "restored the broker state (version %d) from %s: %d of %d partitions hold "
                "data (epochs %s), %d job(s)%s",
                rec.version,
                file.path,
                len(known),
                rec.n_partitions,
                ",".join(str(r.epoch) for r in rec.partitions),
                len(rec.jobs),
                f", sync step {rec.clocks.committing} committing"
                if rec.clocks.committing is not None
                else "",
            )
        self.writer = StateWriter(file, self.state_record, written=rec)

    def state_changed(self) -> None:
        if self.writer is not None:
            self.writer.changed()

    def status(self) -> dict[str, Any] | None:
        """The data dir's record, for the status report (None without one)."""
        w = self.writer
        if w is None:
            return None
        return {
            "path": str(w.file.path),
            "version": w.written.version if w.written else None,
            "writes": w.writes,
            "write_failures": w.failures,
        }

    def epoch_unrecorded(self, p: int) -> bool:
        """Whether partition ``p``'s confirmed epoch is newer than the one recorded (its
        new primary's lease echoes wait for the record): on disk; without a data dir, in
        a pair, in the standby's copy, which a takeover starts from (then this asks to
        learn when the standby holds it); never for a single broker without a data dir.
        Rule: a promoted primary takes no write before the record that names its epoch
        would survive this broker."""
        written = self.writer.written if self.writer is not None else None
        if self.writer is None:
            pair = self.pair
            if pair is None:
                return False
            epoch = self.state.floor_of(p)[0]
            if self._held_floor.get(p, -1) >= epoch:
                return False

            def held() -> None:
                self._held_floor[p] = max(self._held_floor.get(p, -1), epoch)

            pair.after_held(held)
            return True
        if written is None or p >= len(written.partitions):
            return True
        return written.partitions[p].floor_epoch < self.state.floor_of(p)[0]

    async def send_durable(self, frames: list[Any]) -> bool:
        """Send once the state as it is now is in the data dir (at once without one)
        and, in a pair, in the standby's copy (:meth:`Pair.after_held
        <zps.broker.pair.Pair.after_held>`): a takeover starts from that copy, so nothing
        that acknowledged writes depend on goes out before it holds it."""
        pair, post = self.pair, self._post
        if self.writer is None and pair is None:
            return await self._send(frames)

        def written() -> None:
            if pair is None:
                post(frames)
            else:
                pair.after_held(lambda: post(frames))

        if self.writer is None:
            written()
        else:
            self.writer.after_write(written)
        return True

    async def control(
        self,
        node: bytes,
        mtype: MsgType,
        header: dict[str, Any],
        req_id: int = 0,
        *,
        durable: bool = False,
    ) -> None:
        """Broker-originated message (an answer carries its request's id); shards (and
        their liveness links) get the empty source frame.  ``durable``: sent once the
        state as it is now is in the data dir."""
        prefix = [node, b""] if node.startswith(b"s-") or is_liveness(node) else [node]
        if self.pair is not None:  # fencing: shards and clients obey the highest term
            header = {**header, "term": self.pair.term}
        frames = [*prefix, *encode(Route(mtype, req_id=req_id), header)]
        await (self.send_durable if durable else self._send)(frames)
