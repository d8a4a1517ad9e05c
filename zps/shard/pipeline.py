"""The shard's request pipeline: a client's request from its frames to its reply.

The driver of :mod:`zps.shard.admission`: it reads the payloads (from a client's shared
memory too), asks :func:`~zps.shard.admission.admit` for a verdict, runs the core, and
carries out the :func:`~zps.shard.admission.plan`: replicate and log, answer at once,
once the log holds the write, or once the replicas do too; answers to background
writes are held (:class:`~zps.shard.admission.HeldAcks`) on a timer of its own.

It sends through ``post`` (the broker link, or the routing broker the client came by)
and streams through a :class:`Replicator` (the primary's stream); it owns no socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import monotonic, perf_counter
from typing import Any, Protocol

import msgpack

from zps import shm
from zps.errors import ProtocolError
from zps.ops.metrics import LatencyHistogram
from zps.protocol.codec import Message, MsgType, Route, decode, encode, unpack_route
from zps.protocol.messages import Role, Status, StatusReply
from zps.shard import admission
from zps.shard.admission import (
    FLOAT_SIZES,
    NOW,
    Refuse,
    Wait,
    admit,
    grad_frames,
    malformed,
    mutates,
    plan,
    shm_refusal,
)
from zps.shard.core import ShardCore
from zps.shard.durability import Durability
from zps.shard.primary import Reply
from zps.shard.session import ShardSession
from zps.transport import frame_buffer, message_bytes

log = logging.getLogger("zps.shard")


class Replicator(Protocol):
    """What the pipeline uses of the primary's stream (:class:`ReplicationStream`)."""

    def replicate(self, prev: int, frames: list[Any], *, checked: bool = False) -> None: ...

    def stage_room(self) -> int: ...


def _reply_route(route: Route, epoch: int) -> Route:
    """The route of a reply made here (a refusal, or a write's final part)."""
    return Route(MsgType.REPLY, route.partition, epoch, route.req_id)


class HeldAck(list[Any]):
    """The final reply to a request whose writes are all background pushes (``lz``):
    once released, held for the client's next reply that goes at once to carry
    (``acked``)."""

    __slots__ = ("req_id", "res")

    def __init__(self, frames: list[Any], req_id: int, res: list[dict[str, Any] | None]) -> None:
        super().__init__(frames)
        self.req_id = req_id
        self.res = res


def told_no_shm(reply: list[Any], node_id: str) -> list[Any]:
    """``reply`` with ``noshm: open`` (and this shard, ``by``) in its header."""
    header = msgpack.unpackb(reply[1], raw=False)
    header["noshm"], header["by"] = "open", node_id
    return [reply[0], msgpack.packb(header, use_bin_type=True), *reply[2:]]


class RequestPipeline:
    """Clients' requests, their replies and the writes waiting for the log or replicas."""

    def __init__(
        self,
        core: ShardCore,
        session: ShardSession[Reply],
        durability: Durability,
        *,
        policy: admission.Policy,
        hold_s: float,
        post: Callable[[list[Any]], None],
        shared: shm.SharedMemory | None,
    ) -> None:
        self.core = core
        self.session = session
        self.durability = durability
        self.policy = policy
        self._post = post
        self._shm = shared
        #: The primary's stream (set once it exists: see ShardServer._run).
        self.replicator: Replicator | None = None
        #: Replies held for the broker link (its Outbound's held bytes), for rule 4.
        self.held_bytes: Callable[[], int] = lambda: 0
        #: Time to handle a request, by kind (read, write): zps_shard_request_seconds.
        self.latency = {k: LatencyHistogram() for k in ("read", "write")}
        self._read_latency, self._write_latency = self.latency["read"], self.latency["write"]
        self.overloaded = 0  # requests refused OVERLOADED (the broker link was full)
        #: Released answers to clients' background writes, waiting to ride on the next
        #: reply to the same client (at most ``ack_hold_s``).
        self.acks = admission.HeldAcks(hold_s)
        self._held_timer: asyncio.TimerHandle | None = None

    def request(self, source: bytes, route: Route, frames: list[Any]) -> None:
        """Carry out the admission rules (zps.shard.admission) for a client's request."""
        stream = self.replicator
        assert stream is not None
        bufs = list(map(frame_buffer, frames))
        core = self.core
        d = self.durability
        log_waits = d.waits
        shm_reply = no_shm_reply = False
        finite: dict[int, str] | None = None
        verdict: admission.Verdict
        try:
            msg = decode(bufs, route=route)
            header = msg.header
            writes = mutates(header)
            if shm.KEY in header:
                # Payloads in the client's shared memory: copied here first, so what is
                # applied, logged and replicated is this process's own (a write's into
                # this process's arena, when followers read the stream from there).
                # Only a write's header frame is logged and replicated (only MUTATIONS
                # change the state, and mutates() tests those names): a read's stays as
                # it came, naming the client's memory.
                grads = grad_frames(header) if writes else {}
                got = (self._shm or shm.OFF).inbound(
                    bufs,
                    header,
                    stage=stream.stage_room() if writes else 0,
                    reader=source,
                    check={i: FLOAT_SIZES[dt] for i, dt in grads.items()},
                    header_frame=writes,
                )
                frames = bufs = got.frames
                header = got.header  # read once
                msg = Message(msg.route, header, bufs[2:])
                shm_reply, no_shm_reply = got.reply_ok, got.reply_refused
                finite = {i: grads[i] for i in got.finite}
        except shm.ShmUnavailableError as e:
            verdict = shm_refusal(
                str(e), busy=e.busy, permanent=e.permanent, token=e.token, policy=self.policy
            )
        except ProtocolError as e:
            verdict = malformed(str(e))
        else:
            verdict = admit(
                source,
                route.mtype,
                header,
                writes,
                self.policy,
                self.session,
                self.held_bytes(),
                log_waits,
                monotonic(),
            )
        if isinstance(verdict, Refuse):
            self.count(verdict)
            self._post([source, *encode(_reply_route(route, core.epoch), verdict.header())])
            return
        prev = core.lsn
        t0 = perf_counter()
        acks = self.acks
        held = acks.take(source, verdict.lazy)
        done = core.handle_request(
            route, header, msg.payloads, finite, split=verdict.split, acked=held
        )
        reply = done.reply
        changed = done.changed
        if done.carried:
            acks.carried(source)  # they ride on this reply
        (self._write_latency if changed else self._read_latency).observe(perf_counter() - t0)
        if shm_reply and self._shm is not None and self._shm.wants(reply):
            # The client copies the large frames; dense values are lent, not copied.
            reply = self._shm.outbound(reply, lend_to=source)[0]
        elif no_shm_reply:
            # A client on another host (or this shard's path off): told once, so that
            # it stops asking (and stops sending payloads this way to this shard).
            reply = told_no_shm(reply, self.policy.node_id)
        todo = plan(
            verdict,
            done,
            0 if changed else message_bytes(reply),
            log_waits and d.durable < core.lsn,
            self.policy,
        )
        if todo is NOW:
            self._post([source, *reply])
            return
        if todo.too_large is not None:
            core.stats.errors += 1
            reply = encode(
                _reply_route(route, core.epoch),
                StatusReply(Status.BAD_REQUEST, todo.too_large).to_wire(),
            )
        if todo.give_back and held:
            acks.give_back(source, held)
        if todo.replicate:
            stream.replicate(prev, frames, checked=done.clean)
            d.log(core.epoch, prev, core.lsn, bufs[1:])
        if todo.first_part:
            # Reads see what the primary applied, as any other client's reads do: only
            # the writes' acknowledgement waits.
            self._post([source, *reply])
            assert done.writes_res is not None
            reply = encode(_reply_route(route, core.epoch), {"st": "OK", "res": done.writes_res})
            if todo.hold_final:
                reply = HeldAck(reply, route.req_id, done.writes_res)
        wait = todo.wait
        if wait is Wait.NOW:
            self._post([source, *reply])
        elif wait is Wait.LOG:
            d.after(core.lsn, lambda: self._post([source, *reply]))
        else:  # Wait.REPLICAS
            lsn, epoch = core.lsn, core.epoch
            d.after(lsn, lambda: self.logged_write(lsn, epoch, (source, reply)))

    def count(self, refusal: admission.Refuse) -> None:
        """A refusal counts in the statistic it names."""
        if refusal.count is admission.Count.MALFORMED:
            self.core.stats.malformed += 1
        elif refusal.count is admission.Count.OVERLOADED:
            self.overloaded += 1

    def logged_write(self, lsn: int, epoch: int, item: Reply) -> None:
        """A write is in the log (as the durability mode requires): it now waits for the
        replicas, unless the primary stepped down meanwhile."""
        core = self.core
        if core.primary and core.epoch == epoch and self.session.role is Role.PRIMARY:
            self.release(self.session.add_write(lsn, item))
        else:
            self.refuse([item])

    def refuse(
        self, waiting: list[Reply], status: Status = Status.NOT_PRIMARY, why: str = ""
    ) -> None:
        """Writes still waiting for replicas get ``status``: NOT_PRIMARY when the
        primary stepped down, NOT_ENOUGH_REPLICAS when too few copies are in sync."""
        for client, frames in waiting:
            route = unpack_route(frames[0])
            refusal = encode(
                Route(MsgType.REPLY, route.partition, route.epoch, route.req_id),
                StatusReply(status, why or "the primary stepped down").to_wire(),
            )
            self._post([client, *refusal])
        if waiting and status is not Status.NOT_PRIMARY:
            log.warning("refused %d waiting writes: %s", len(waiting), why)
        elif waiting:
            log.warning(
                "stepped down with %d writes unacknowledged; clients will retry", len(waiting)
            )

    def release(self, replies: list[Reply]) -> None:
        """Writes now held by every copy required: answered (or held, see hold)."""
        for client, frames in replies:
            if isinstance(frames, HeldAck):
                self.hold(client, frames)
            else:
                self._post([client, *frames])

    def hold(self, client: bytes, ack: HeldAck) -> None:
        """The answer to background writes, now held by the replicas: carried by the
        client's next reply that goes at once, or sent on its own after
        ``shard.ack_hold_s`` (admission.HeldAcks)."""
        now = self.acks.hold(client, ack.req_id, ack.res)
        if now is not None:
            self._send_held(client, now)
        elif self._held_timer is None:
            loop = asyncio.get_running_loop()
            self._held_timer = loop.call_later(self.acks.hold_s, self._flush_held)

    def _flush_held(self) -> None:
        self._held_timer = None
        for client, acks in self.acks.release().items():
            self._send_held(client, acks)

    def _send_held(self, client: bytes, acks: list[list[Any]]) -> None:
        (req_id, res), rest = acks[0], acks[1:]
        header: dict[str, Any] = {"st": "OK", "res": res}
        if rest:
            header["acked"] = rest
        p = self.core.partition or 0
        self._post([client, *encode(Route(MsgType.REPLY, p, self.core.epoch, req_id), header)])
