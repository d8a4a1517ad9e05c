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
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from zps import shm, transport
from zps.errors import ProtocolError
from zps.ops.metrics import LatencyHistogram
from zps.protocol.codec import Message, MsgType, Route, decode, encode, unpack_route
from zps.protocol.messages import Role, Status, StatusReply
from zps.shard import admission
from zps.shard.admission import (
    FLOAT_SIZES,
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

log = logging.getLogger("zps.shard")


class Replicator(Protocol):
    """What the pipeline uses of the primary's stream (:class:`ReplicationStream`)."""

    def replicate(self, prev: int, frames: list[Any], *, checked: bool = False) -> None: ...

    def stage_room(self) -> int: ...


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
        self.overloaded = 0  # requests refused OVERLOADED (the broker link was full)
        #: Released answers to clients' background writes, waiting to ride on the next
        #: reply to the same client (at most ``ack_hold_s``).
        self.acks = admission.HeldAcks(hold_s)
        self._held_timer: asyncio.TimerHandle | None = None

    def request(self, source: bytes, route: Route, frames: list[Any]) -> None:
        """Carry out the admission rules (zps.shard.admission) for a client's request."""
        stream = self.replicator
        assert stream is not None
        bufs = [transport.frame_buffer(f) for f in frames]
        core = self.core
        reply_route = Route(MsgType.REPLY, route.partition, core.epoch, route.req_id)
        shm_reply = no_shm_reply = False
        finite: dict[int, str] = {}
        writes = False
        verdict: admission.Verdict
        try:
            msg = decode(bufs, route=route)
            writes = mutates(msg.header)
            if shm.KEY in msg.header:
                # Payloads in the client's shared memory: copied here first, so what is
                # applied, logged and replicated is this process's own (a write's into
                # this process's arena, when followers read the stream from there).
                # Only a write's header frame is logged and replicated (only MUTATIONS
                # change the state, and mutates() tests those names): a read's stays as
                # it came, naming the client's memory.
                grads = grad_frames(msg.header) if writes else {}
                got = (self._shm or shm.OFF).inbound(
                    bufs,
                    msg.header,
                    stage=stream.stage_room() if writes else 0,
                    reader=source,
                    check={i: FLOAT_SIZES[d] for i, d in grads.items()},
                    header_frame=writes,
                )
                frames = bufs = got.frames
                msg = Message(msg.route, got.header, bufs[2:])  # the header read once
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
                msg.header,
                writes=writes,
                policy=self.policy,
                lease=self.session,
                held_bytes=self.held_bytes(),
                log_waits=self.durability.waits,
                now=time.monotonic(),
            )
        if isinstance(verdict, Refuse):
            self.count(verdict)
            self._post([source, *encode(reply_route, verdict.header())])
            return
        prev = core.lsn
        t0 = time.perf_counter()
        acks = self.acks
        held = acks.take(source, verdict.lazy)
        done = core.handle_request(
            route, msg.header, msg.payloads, finite, split=verdict.split, acked=held
        )
        reply = done.reply
        if done.carried:
            acks.carried(source)  # they ride on this reply
        self.latency["write" if done.changed else "read"].observe(time.perf_counter() - t0)
        if shm_reply and self._shm is not None and self._shm.wants(reply):
            # The client copies the large frames; dense values are lent, not copied.
            reply = self._shm.outbound(reply, lend_to=source)[0]
        elif no_shm_reply:
            # A client on another host (or this shard's path off): told once, so that
            # it stops asking (and stops sending payloads this way to this shard).
            reply = told_no_shm(reply, self.policy.node_id)
        d = self.durability
        todo = plan(
            verdict,
            done,
            reply_bytes=0 if done.changed else transport.message_bytes(reply),
            log_behind=d.waits and d.durable < core.lsn,
            policy=self.policy,
        )
        if todo.too_large is not None:
            core.stats.errors += 1
            reply = encode(reply_route, StatusReply(Status.BAD_REQUEST, todo.too_large).to_wire())
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
            reply = encode(reply_route, {"st": "OK", "res": done.writes_res})
            if todo.hold_final:
                reply = HeldAck(reply, route.req_id, done.writes_res)
        lsn, epoch = core.lsn, core.epoch
        match todo.wait:
            case Wait.NOW:
                self._post([source, *reply])
            case Wait.LOG:
                d.after(lsn, lambda: self._post([source, *reply]))
            case Wait.REPLICAS:
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
