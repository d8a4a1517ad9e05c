"""The client's request lifecycle as a pure state machine: no sockets, no clock.

The driver (:class:`zps.client.client.Client`) feeds it events: a partition request to
submit, a broker call (CLOCK, TASK, STATUS), a received reply, a new cluster map, a timer
tick; each returns the actions to carry out: frames to :class:`Send`, results to
:class:`Deliver`, errors to :class:`Fail`.  Time is always an argument (``now``); the
driver calls :meth:`ClientSession.tick` at :meth:`ClientSession.next_wakeup`.

Rules:

1. Every request and broker call waits in one table keyed by its request id; a reply is
   matched by that id only (a STATUS answer too), and an id leaves the table exactly once:
   so every token gets exactly one :class:`Deliver` or :class:`Fail`, and late or
   duplicate replies are ignored.
2. A partition request carries ``(cid, seq)``; ``seq`` is allocated here, increasing, and
   a re-send repeats the request's frames unchanged (same seq, same body): the shard
   applies it once.
3. NOT_PRIMARY, STALE_EPOCH, OVERLOADED and NOT_ENOUGH_REPLICAS park a request; it is
   re-sent at its backoff time ``min(0.01 * 2**min(attempts - 1, 8), max_backoff)``, or at
   once on a map whose epoch for its partition differs.  Only its deadline ends the
   retries: no count of attempts does.  One still refused NOT_ENOUGH_REPLICAS at its
   deadline fails with that error.
4. A map from a new broker incarnation re-sends everything in flight, broker calls
   included: the restarted broker may have dropped it.
5. A request waits while no copy of its partition serves: the map names no primary (a
   promotion, the broker's start-up hold) or marks the partition lost, or the answer is
   SHARD_UNAVAILABLE (no live copy) or NOT_PRIMARY.  It is parked as in rule 3; while the
   map names no primary it is not sent, only checked again at its backoff time, and it
   is sent at once on a map that names one.  Its deadline (``now + timeout`` at
   submission) ends the wait: one still waiting for a copy then fails with
   ShardUnavailableError naming the partition, what was missing and how long it waited;
   any other as rule 3 says, or with ZpsTimeoutError naming its last refusal.  A
   partition that a map from a new broker incarnation does not list, while the request
   was submitted under another, is waited for alike: a broker that restarted without its
   record learns the partitions from the shards during its hold (zps/core/slotclaims.py).
   Lazy requests wait alike.  Calls made ``forever``, and every request of a session whose
   timeout is infinite, have no deadline and wait as long as it takes.  A partition the
   map does not have fails at once.
6. With a broker pair (:class:`BrokerChoice`), a switch to the other broker re-sends
   everything in flight on its first map, whatever that map's version; a PASSIVE answer
   parks a request (and leaves a broker call waiting) until then.
7. A request of several operations asks for its reply in two parts (``er``): a primary
   whose answer to its writes waits for the replicas (or the log) answers its reads at
   once (``part``), and the writes later.  The first part is delivered ``partial`` and the
   request stays in the table, re-sent whole if need be: its reads' later answers are
   ignored by the driver, as any late answer is.  The answer to a ``lazy`` request's
   writes (background pushes) may ride on a later reply from the same shard (``acked``:
   ``[req_id, results]`` pairs), each handled as that request's own reply.
8. An answer ``MOVED`` (live resharding: the partition no longer holds some slots of the
   request's operations, and applied none of them) ends the request with a
   :class:`Resubmit`: each of its operations split again by the newest map
   (:func:`zps.core.routing.resplit`; an operation on no slot goes whole to the same
   partition), to be submitted as new requests, which keep the refused request's
   deadline: a map that keeps sending them back (one rebuilt by a broker that lost its
   record, say) ends in the caller's timeout, not in an endless loop.  A second
   ``MOVED`` under the same map version also asks the broker for the map (HELLO): the
   newer one is not here yet; and its new requests are held back (``after``) until it
   comes, for 10 ms plus as long as that map version has been answered ``MOVED``, at
   most ``max_backoff``: a map that stays stale is not spun on at the round trip's rate.
9. A final reply with no answer for a read (``None``: the first part that carried it
   was lost) delivers the others and names the read in :attr:`Deliver.again`: it is
   submitted again, whole, to the same partition, as a new request (a read may be; a
   write never is under a new sequence number).
10. The broker's word that a partition's primary made its data link again
    (``relinked``) re-sends at once every request in flight to that partition and not
    parked: the connection before may have taken it, or its reply, with it.  This
    client's own connection to the broker made again re-sends every request in flight
    and not parked, and every broker call (as rule 4).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

import numpy as np

from zps.core.routing import ClusterMap, PartitionInfo, Resplit, resplit
from zps.errors import (
    JobFailedError,
    NotEnoughReplicasError,
    ShardUnavailableError,
    ZpsTimeoutError,
    remote_error,
)
from zps.protocol.codec import Encoder, Message, MsgType, Route, encode
from zps.protocol.messages import ClientHello
from zps.protocol.ops import READS

T = TypeVar("T")

RETRY_CODES = frozenset(
    {
        "NOT_PRIMARY",
        "STALE_EPOCH",
        "OVERLOADED",
        "NOT_ENOUGH_REPLICAS",
        "PASSIVE",
        "SHARD_UNAVAILABLE",
    }
)
#: What a request waiting for a copy of its partition misses (rule 5).
LOST = "lost"
NO_PRIMARY = "no primary"
NO_COPY = "no live copy"
UNLISTED = "not listed by the restarted broker"
NO_SUCH_PARTITION = "no such partition"
#: Refusals that say no copy of the partition serves (rule 5), with what is missing.
_MISSING_BY_CODE = {"SHARD_UNAVAILABLE": NO_COPY, "NOT_PRIMARY": NO_PRIMARY}
#: The broker calls: answered by the broker itself, with a reply of the same type.
BROKER_CALLS = frozenset({MsgType.CLOCK, MsgType.TASK, MsgType.STATUS})


@dataclass(frozen=True, slots=True)
class Send:
    """Frames to send to the broker; ``req_id`` is the request they carry (0: none)."""

    frames: list[Any]
    req_id: int = 0


@dataclass(frozen=True, slots=True)
class Deliver(Generic[T]):
    """A request was answered: ``msg`` is the reply (its status was OK).  ``partial``:
    the answers of its reads only (a result per operation, ``None`` for each write);
    the request waits on for its writes' answer (rule 7).  ``again``: the operations (by
    index) the reply has no answer for, to submit again whole to ``msg``'s partition
    (rule 9)."""

    token: T
    msg: Message
    partial: bool = False
    again: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Resubmit(Generic[T]):
    """Request ``req_id`` ended unapplied (``MOVED``, rule 8): submit each of its
    operations again as new requests, by ``plans[i]`` (its pieces by the newest map and
    how to join their results; None: whole, to ``partition``)."""

    token: T
    req_id: int
    partition: int
    plans: tuple[Resplit | None, ...]
    #: The refused request's deadline: the new requests keep it (rule 8).
    deadline: float = math.inf
    #: Seconds to hold the new requests back unless a newer map comes first (rule 8).
    after: float = 0.0


@dataclass(frozen=True, slots=True)
class Fail(Generic[T]):
    """A request ended with an error."""

    token: T
    error: BaseException


Action: TypeAlias = Send | Deliver[T] | Fail[T] | Resubmit[T]


class Part(Protocol):
    """An operation of a request as the session may submit it again (rules 8 and 9): its
    header entry without arrays (``body``), its arrays by key, its reply's array bytes."""

    @property
    def body(self) -> dict[str, Any]: ...
    @property
    def arrays(self) -> dict[str, np.ndarray]: ...
    @property
    def reply_bytes(self) -> int: ...


@dataclass
class ClientStats:
    requests: int = 0
    ops: int = 0
    retries: int = 0
    #: Replies that answered a request's reads before its writes (rule 7).
    early_replies: int = 0
    #: Answers to background writes that rode on another reply (``acked``).
    carried_acks: int = 0
    by_partition: collections.Counter[int] = field(default_factory=collections.Counter)


@dataclass(slots=True)
class _Request(Generic[T]):
    token: T
    partition: int
    body: list[Any]  # header and payload frames, re-sent unchanged on retry
    epoch: int
    deadline: float
    submitted: float
    attempts: int = 1
    parked: bool = False  # waiting to be re-sent (a newer map, or a short backoff)
    due_at: float = 0.0  # when a parked request is re-sent
    short: str = ""  # the last NOT_ENOUGH_REPLICAS message: raised instead of a timeout
    #: What it waits for (rule 5: LOST, NO_PRIMARY, NO_COPY), "" once sent to a primary
    #: the map names; ``why``: the refusal's message that said so.
    missing: str = ""
    why: str = ""
    last: str = ""  # the last refusal (code: message), named by a timeout
    #: Its operations as they may be submitted again (rules 8, 9); None: never.
    parts: Sequence[Part] | None = None
    #: The broker incarnation of the map it was submitted under (rule 5).
    incarnation: str = ""


@dataclass(slots=True)
class _Call(Generic[T]):
    token: T
    mtype: MsgType
    header: dict[str, Any]
    limit: float | None  # seconds allowed, None: forever


class ClientSession(Generic[T]):
    """Tracks every request in flight from submission to its one outcome."""

    def __init__(
        self,
        cid: bytes,
        *,
        timeout: float,
        max_backoff: float,
        hello: ClientHello | None = None,
        acks: int | None = None,
    ) -> None:
        self.cid = cid
        self.timeout = timeout
        self.max_backoff = max_backoff
        self.map: ClusterMap | None = None
        self.stats = ClientStats()
        self._hello = hello or ClientHello()
        self._acks = acks
        self._req_ids = itertools.count(1)
        self._seqs = itertools.count(1)
        self._table: dict[int, _Request[T] | _Call[T]] = {}
        # Deadlines in submission order: the timeout is one for all, so the first is the
        # earliest (an OrderedDict finds its first entry in O(1) after many deletions).
        self._deadlines: collections.OrderedDict[int, float] = collections.OrderedDict()
        # Deadlines earlier than the last submitted (operations submitted again keep
        # theirs, rule 8): a heap of (deadline, req_id) whose first entry is always of a
        # request still waiting (:meth:`_forget` drops those gone from its top).
        self._early: list[tuple[float, int]] = []
        self._due: list[tuple[float, int]] = []  # (due_at, req_id); stale entries skipped
        self._switched = False  # the next map comes from another broker of the pair
        self._moved_at = -1  # the map version of the last MOVED answer (rule 8)
        self._moved_since = 0.0  # when that version was first answered MOVED

    def __len__(self) -> int:
        """Requests and broker calls in flight."""
        return len(self._table)

    @property
    def timers(self) -> int:
        """Request timers held (live ones, and stale ones not yet dropped): bounded by
        the requests in flight, whatever the maps and backoffs do."""
        return len(self._due)

    # -- events --------------------------------------------------------------

    def hello(self) -> Send:
        """The HELLO that asks the broker for the map (and introduces this client)."""
        return Send(encode(Route(MsgType.HELLO), self._hello.to_wire()))

    def submit(
        self,
        partition: int,
        ops: list[dict[str, Any]],
        encoder: Encoder,
        token: T,
        now: float,
        *,
        lazy: bool = False,
        parts: Sequence[Part] | None = None,
        deadline: float | None = None,
    ) -> list[Action[T]]:
        """A request of ``ops`` (their arrays already added to ``encoder``) to ``partition``.
        ``lazy``: no caller waits for its writes (background pushes): their answer may
        come with a later reply (rule 7).  ``parts``: the same operations, one each, with
        their arrays: what is submitted again after ``MOVED`` or a missed read (rules 8,
        9; without them a ``MOVED`` fails the request).  ``deadline``: the end of the
        wait of operations submitted again (rule 8), when earlier than the session's."""
        cmap = self.map
        info = cmap.partitions.get(partition) if cmap is not None else None
        if cmap is not None and info is None:
            return [Fail(token, self._no_such(partition, 0.0))]
        header: dict[str, Any] = {"cid": self.cid, "seq": next(self._seqs), "ops": ops}
        if self._acks is not None:
            header["acks"] = self._acks
        if len(ops) > 1:
            header["er"] = 1  # its reads may be answered before its writes (rule 7)
            if lazy:
                header["lz"] = 1
        req_id = next(self._req_ids)
        epoch = info.epoch if info is not None else 0
        frames = encoder.build(Route(MsgType.REQUEST, partition, epoch, req_id), header)
        if deadline is None or deadline > now + self.timeout:
            deadline = now + self.timeout
        req = _Request(token, partition, frames[1:], epoch, deadline, now, parts=parts)
        req.incarnation = cmap.incarnation if cmap is not None else ""
        self._table[req_id] = req
        if deadline == math.inf:
            pass
        elif self._deadlines and deadline < next(reversed(self._deadlines.values())):
            heapq.heappush(self._early, (deadline, req_id))
        else:
            self._deadlines[req_id] = deadline
        stats = self.stats
        stats.requests += 1
        stats.ops += len(ops)
        stats.by_partition[partition] += 1
        missing = _missing(info)
        if missing:  # no copy serves (rule 5): wait for a map that names a primary
            req.missing = missing
            self._park(req_id, req, now)
            return []
        return [Send(frames, req_id)]

    def call(
        self, mtype: MsgType, header: dict[str, Any], token: T, now: float, *, forever: bool = False
    ) -> tuple[int, list[Action[T]]]:
        """A call the broker answers itself; returns its request id and what to send."""
        if mtype not in BROKER_CALLS:
            raise ValueError(f"{mtype.name} is not a broker call")
        req_id = next(self._req_ids)
        self._table[req_id] = _Call(token, mtype, header, None if forever else self.timeout)
        if not forever:
            self._deadlines[req_id] = now + self.timeout
        return req_id, [Send(encode(Route(mtype, req_id=req_id), header), req_id)]

    def on_reply(self, msg: Message, now: float) -> list[Action[T]]:
        """A REPLY from a shard (or the broker), or the answer to a broker call."""
        acked = msg.header.get("acked") if msg.route.mtype is MsgType.REPLY else None
        if acked is not None:
            return [*self._on_acked(msg.route, acked, now), *self._on_reply(msg, now)]
        return self._on_reply(msg, now)

    def _on_acked(self, route: Route, acked: object, now: float) -> list[Action[T]]:
        """Answers to earlier requests' writes that ride on a reply (rule 7); anything
        malformed among them is ignored: those requests time out or are re-sent."""
        actions: list[Action[T]] = []
        if not isinstance(acked, list):
            return actions
        for item in acked:
            if (
                isinstance(item, list)
                and len(item) == 2
                and type(item[0]) is int
                and isinstance(item[1], list)
            ):
                r = Route(MsgType.REPLY, route.partition, route.epoch, item[0])
                got = self._on_reply(Message(r, {"st": "OK", "res": item[1]}, []), now)
                self.stats.carried_acks += len(got)
                actions.extend(got)
        return actions

    def _on_reply(self, msg: Message, now: float) -> list[Action[T]]:
        req_id = msg.route.req_id
        entry = self._table.get(req_id)
        if entry is None:
            return []  # a late answer to a request that was already answered or timed out
        header = msg.header
        status = header.get("st")
        if isinstance(entry, _Call):
            if msg.route.mtype is not entry.mtype or status == "PASSIVE":
                return []  # a standby broker: re-sent after the switch (rule 6)
            self._forget(req_id)
            if entry.mtype is MsgType.STATUS:
                return [Deliver(entry.token, msg)]
            if status == "JOB_FAILED":
                return [Fail(entry.token, JobFailedError(str(header.get("msg", ""))))]
            if status != "OK":
                return [Fail(entry.token, remote_error(str(status), str(header.get("msg", ""))))]
            return [Deliver(entry.token, msg)]
        if msg.route.mtype is not MsgType.REPLY:
            return []
        if status in RETRY_CODES:
            # Failing over, no copy serving, or our map is out of date: try again shortly
            # (rules 3 and 5).
            text = str(header.get("msg", ""))
            cmap = self.map
            if (
                status == "SHARD_UNAVAILABLE"
                and cmap
                and entry.partition not in cmap.partitions
                and not _unlisted(entry, cmap)
            ):
                self._forget(req_id)
                return [Fail(entry.token, self._no_such(entry.partition, now - entry.submitted))]
            entry.short = text if status == "NOT_ENOUGH_REPLICAS" else ""
            entry.missing = _MISSING_BY_CODE.get(str(status), "")
            entry.why = text if entry.missing else ""
            entry.last = f"{status}: {text}" if text else str(status)
            self._park(req_id, entry, now)
            return [self.hello()] if status == "STALE_EPOCH" else []
        if status == "OK" and header.get("part") == 1:
            self.stats.early_replies += 1
            return [Deliver(entry.token, msg, partial=True)]  # the writes' answer follows
        self._forget(req_id)
        if status == "OK":
            return [Deliver(entry.token, msg, again=_unanswered(entry.parts, header))]
        if status == "MOVED" and entry.parts is not None and self.map is not None:
            return self._moved(req_id, entry, self.map, now)
        return [Fail(entry.token, remote_error(str(status), str(header.get("msg", ""))))]

    def _moved(
        self, req_id: int, req: _Request[T], cmap: ClusterMap, now: float
    ) -> list[Action[T]]:
        """Each operation of a request refused ``MOVED``, split again by ``cmap`` (rule 8)."""
        assert req.parts is not None
        actions: list[Action[T]] = []
        after = 0.0
        if self._moved_at == cmap.version:  # the newer map is not here yet: ask for it
            actions.append(self.hello())
            after = min(0.01 + (now - self._moved_since), self.max_backoff)
        else:
            self._moved_at, self._moved_since = cmap.version, now
        plans = tuple(resplit(p.body, p.arrays, p.reply_bytes, cmap) for p in req.parts)
        actions.append(Resubmit(req.token, req_id, req.partition, plans, req.deadline, after))
        return actions

    def on_map(self, new: ClusterMap, now: float) -> list[Action[T]]:
        """A map from the broker: kept unless older; re-sends what it concerns."""
        old = self.map
        restarted = old is not None and (new.incarnation != old.incarnation or self._switched)
        self._switched = False
        if old is not None and not restarted and new.version < old.version:
            return []
        self.map = new
        actions: list[Action[T]] = []
        for req_id, entry in list(self._table.items()):
            if isinstance(entry, _Call):
                if restarted:
                    frames = encode(Route(entry.mtype, req_id=req_id), entry.header)
                    actions.append(Send(frames, req_id))
                continue
            info = new.partitions.get(entry.partition)
            # A restarted broker may have dropped anything in flight; a new epoch
            # means a new primary.  Dedup makes re-sending safe.
            if (
                restarted
                or entry.parked
                or info is None
                or info.epoch != entry.epoch
                or info.primary is None
                or info.lost
            ):
                actions.extend(self._resend(req_id, entry, now))
        return actions

    def switched(self) -> None:
        """The driver now talks to the other broker of the pair: its first map re-sends
        everything in flight (rule 6)."""
        self._switched = True

    def tick(self, now: float) -> list[Action[T]]:
        """Fail what is past its deadline, then re-send what is due."""
        actions: list[Action[T]] = []
        while self._deadlines:
            req_id, deadline = next(iter(self._deadlines.items()))
            if deadline > now:
                break
            actions.append(self._expire(req_id, now))
        while self._early and self._early[0][0] <= now:
            actions.append(self._expire(self._early[0][1], now))
        while self._due and self._due[0][0] <= now:
            due_at, req_id = heapq.heappop(self._due)
            entry = self._table.get(req_id)
            if isinstance(entry, _Request) and entry.parked and entry.due_at == due_at:
                actions.extend(self._resend(req_id, entry, now))
        return actions

    def _expire(self, req_id: int, now: float) -> Fail[T]:
        expired = self._table[req_id]
        self._forget(req_id)
        if isinstance(expired, _Request) and expired.missing:
            # Waited for a copy of its partition until the end (rule 5): say which.
            err: BaseException = self._unavailable(expired, now)
        elif isinstance(expired, _Request) and expired.short:
            # Refused for want of in-sync replicas until the end: say so.
            err = NotEnoughReplicasError(expired.short)
        else:
            err = ZpsTimeoutError(self._timeout_message(expired))
        return Fail(expired.token, err)

    def earliest_deadline(self) -> float | None:
        """The earliest deadline of a request or timed broker call in flight (None:
        none has one).  Safe from another thread (zps-worker's watchdog): it only reads,
        and a table changed during the read (the driver is busy) gives None."""
        try:
            first = next(iter(self._deadlines.values()), None)
            early = self._early[0][0] if self._early else None
        except (RuntimeError, IndexError):  # changed during the read
            return None
        return first if early is None or (first is not None and first < early) else early

    def next_wakeup(self) -> float | None:
        """When :meth:`tick` has something to do next (None: nothing is timed)."""
        at = None
        if self._due:
            self._drop_stale_due()
            if self._due:
                at = self._due[0][0]
        if self._deadlines:
            first = next(iter(self._deadlines.values()))
            if at is None or first < at:
                at = first
        if self._early and (at is None or self._early[0][0] < at):
            at = self._early[0][0]
        return at

    def relinked(self, partitions: Sequence[int] | None, now: float) -> list[Action[T]]:
        """Rule 10: re-send what is in flight to ``partitions`` (None: everything, broker
        calls too: this client's connection to the broker was made again)."""
        actions: list[Action[T]] = []
        for req_id, entry in list(self._table.items()):
            if isinstance(entry, _Call):
                if partitions is None:
                    frames = encode(Route(entry.mtype, req_id=req_id), entry.header)
                    actions.append(Send(frames, req_id))
            elif not entry.parked and (partitions is None or entry.partition in partitions):
                actions.extend(self._resend(req_id, entry, now))
        return actions

    def unsent(self, req_id: int, now: float) -> None:
        """The driver could not hand ``req_id`` to a broker of the pair at once (its queue
        is full, or it is gone): a request is parked and re-sent at its backoff time, a
        broker call waits for the switch (rule 6)."""
        entry = self._table.get(req_id)
        if isinstance(entry, _Request):
            self._park(req_id, entry, now)

    def in_flight(self) -> Iterator[tuple[int, T, list[Any]]]:
        """The requests not yet answered, by id, each with its token and the frames
        (header, then payloads) it is re-sent with: the caller may replace a payload
        frame with a copy of the same bytes (see ``Connection._detach``)."""
        for req_id, entry in self._table.items():
            if isinstance(entry, _Request):
                yield req_id, entry.token, entry.body

    def token(self, req_id: int) -> T | None:
        """The token of request ``req_id`` while it is not answered (None: no such)."""
        entry = self._table.get(req_id)
        return entry.token if isinstance(entry, _Request) else None

    def abandon(self, req_id: int, error: BaseException) -> list[Fail[T]]:
        """The driver could not send ``req_id``: it fails with ``error``."""
        entry = self._table.get(req_id)
        if entry is None:
            return []
        self._forget(req_id)
        return [Fail(entry.token, error)]

    def close(self, error: BaseException) -> list[Fail[T]]:
        """Fail everything in flight with ``error``."""
        actions = [Fail(e.token, error) for e in self._table.values()]
        self._table.clear()
        self._deadlines.clear()
        self._early.clear()
        self._due.clear()
        return actions

    # -- internals -----------------------------------------------------------

    def _forget(self, req_id: int) -> None:
        del self._table[req_id]
        self._deadlines.pop(req_id, None)
        early = self._early
        while early and early[0][1] not in self._table:
            heapq.heappop(early)

    def _park(self, req_id: int, req: _Request[T], now: float) -> None:
        """Re-send after a short, growing backoff (or at once on a newer map)."""
        req.parked = True
        req.due_at = now + min(0.01 * 2 ** min(req.attempts - 1, 8), self.max_backoff)
        heapq.heappush(self._due, (req.due_at, req_id))

    def _resend(self, req_id: int, req: _Request[T], now: float) -> list[Action[T]]:
        cmap = self.map
        info = cmap.partitions.get(req.partition) if cmap is not None else None
        unlisted = cmap is not None and info is None and _unlisted(req, cmap)
        if cmap is not None and info is None and not unlisted:
            self._forget(req_id)
            return [Fail(req.token, self._no_such(req.partition, now - req.submitted))]
        req.attempts += 1
        missing = UNLISTED if unlisted else _missing(info)
        if missing:  # still no copy serves (rule 5): checked again at the backoff time
            if missing != req.missing:
                req.missing, req.why = missing, ""
            self._park(req_id, req, now)
            return []
        assert info is not None
        req.missing = req.why = ""
        req.parked = False
        req.epoch = info.epoch
        self.stats.retries += 1
        route = Route(MsgType.REQUEST, req.partition, info.epoch, req_id)
        return [Send([route.pack(), *req.body], req_id)]

    def _drop_stale_due(self) -> None:
        while self._due:
            due_at, req_id = self._due[0]
            entry = self._table.get(req_id)
            if isinstance(entry, _Request) and entry.parked and entry.due_at == due_at:
                return
            heapq.heappop(self._due)

    def _unavailable(self, req: _Request[T], now: float) -> ShardUnavailableError:
        """The error of a request that waited for a copy of its partition until its
        deadline (rule 5)."""
        p, waited = req.partition, now - req.submitted
        if req.missing == LOST:
            what = (
                f"partition {p} is lost (no copy holding its data is live): waiting for a "
                f"copy holding its data to register, or for `zps-server reset-partition "
                f"--partition {p} --accept-data-loss`"
            )
        elif req.missing == NO_PRIMARY:
            why = req.why or "a promotion, the broker's start-up hold, or no copy to elect yet"
            what = f"partition {p} has no primary ({why})"
        elif req.missing == UNLISTED:
            what = f"partition {p} is not in the map of the broker that restarted"
        else:
            what = f"partition {p} has no live copy" + (f" ({req.why})" if req.why else "")
        return ShardUnavailableError(
            f"{what}; gave up after waiting {waited:.1f}s (the client's timeout)",
            partition=p,
            missing=req.missing,
            waited=waited,
        )

    def _no_such(self, partition: int, waited: float) -> ShardUnavailableError:
        n = self.map.n_partitions if self.map is not None else 0
        return ShardUnavailableError(
            f"partition {partition} is not in the cluster map (it has {n} partitions)",
            partition=partition,
            missing=NO_SUCH_PARTITION,
            waited=waited,
        )

    def _timeout_message(self, entry: _Request[T] | _Call[T]) -> str:
        if isinstance(entry, _Request):
            last = f" (last refused: {entry.last})" if entry.last else ""
            return (
                f"request to partition {entry.partition} not answered within "
                f"{self.timeout:g}s{last}"
            )
        if entry.mtype is MsgType.STATUS:
            return "the broker did not answer the status request"
        return f"the broker did not answer {entry.mtype.name} within {entry.limit:g}s"


def _unanswered(parts: Sequence[Part] | None, header: dict[str, Any]) -> tuple[int, ...]:
    """The reads a final reply has no answer for (rule 9)."""
    res = header.get("res")
    if parts is None or not isinstance(res, list) or len(res) != len(parts) or None not in res:
        return ()
    return tuple(
        i
        for i, (p, r) in enumerate(zip(parts, res, strict=True))
        if r is None and p.body.get("op") in READS
    )


def _unlisted(req: _Request[Any], cmap: ClusterMap) -> bool:
    """A map of another broker incarnation than the request's lacks its partition (rule 5)."""
    return bool(req.incarnation) and req.incarnation != cmap.incarnation


def _missing(info: PartitionInfo | None) -> str:
    """What keeps a partition from being served, by the map ("": it names a primary)."""
    if info is None:
        return NO_PRIMARY  # no map yet
    if info.lost:
        return LOST
    return NO_PRIMARY if info.primary is None else ""


class BrokerChoice:
    """Which broker of a pair a client talks to (the Binary Star client), and fencing.

    Rules:

    1. Requests go to the *current* broker.  When it has been silent for ``silence``
       seconds (any message counts), the next one becomes current: the driver introduces
       itself there (HELLO), which is what lets a standby take over.
    2. Brokers of a pair stamp their control messages with their term.  A message with
       a term older than the highest one seen is dropped (a broker that was paused or cut
       off and does not yet know it was replaced); one with a term at least as high from
       another broker makes that broker current (it is the active one).
    3. A standby answers PASSIVE: the driver asks it again every ``retry`` seconds while
       the other one stays silent.

    One endpoint: never switches, never fences (an unpaired broker stamps no term).
    """

    def __init__(self, n: int, *, silence: float, retry: float, now: float) -> None:
        if n < 1:
            raise ValueError("at least one broker endpoint is needed")
        self.n = n
        self.silence = silence
        self.retry = retry
        self.current = 0
        self.term = 0
        self.switches = 0
        self._heard = now
        self._retry_at: float | None = None

    def heard(self, index: int, term: int | None, now: float) -> bool | None:
        """A message from broker ``index`` stamped ``term``: True when it made that broker
        current (re-send what is in flight), None when it must be dropped (fenced)."""
        if term is not None:
            if term < self.term:
                return None
            self.term = term
            if index != self.current:
                self.current = index
                self._heard = now
                self._retry_at = None
                self.switches += 1
                return True
        if index == self.current:
            self._heard = now
            self._retry_at = None
        return False

    def refused(self, index: int, now: float) -> None:
        """Broker ``index`` answered as a standby (rule 3)."""
        if index == self.current and self._retry_at is None:
            self._retry_at = now + self.retry

    def tick(self, now: float) -> str | None:
        """``"switch"``: the current broker changed (introduce yourself there);
        ``"hello"``: ask the current one again; None: nothing to do."""
        if self.n > 1 and now - self._heard >= self.silence:
            self.current = (self.current + 1) % self.n
            self._heard = now
            self._retry_at = None
            self.switches += 1
            return "switch"
        if self._retry_at is not None and now >= self._retry_at:
            self._retry_at = now + self.retry
            return "hello"
        return None
