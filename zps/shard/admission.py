"""The shard's admission rules: what it does with a client's request before its core
runs, and how the reply goes after, decided from the request and the shard's state.

One job: :func:`admit` turns a decoded request into a :data:`Verdict` (refuse it with a
status and a message, or run it, and how); :func:`plan` turns what the core did
(:class:`~zps.shard.core.Handled`) into a :class:`ReplyPlan`; :class:`HeldAcks` keeps
the answers to a client's background writes for its next reply to carry.  The driver
(:mod:`zps.shard.pipeline`) carries them out, and tests predict it from the same
functions.  No I/O, no clock (``now`` is an argument), no state but :class:`HeldAcks`.

Rules before the core runs, in the order they apply:

1. A request whose payloads are in a client's shared memory that this shard cannot
   read is refused ``OVERLOADED`` with ``noshm`` (:func:`shm_refusal`: ``busy`` for a
   while, ``open`` for good, ``gone`` for these regions) and ``by`` (this shard).
2. A message that does not decode, or is not a REQUEST, is refused ``BAD_REQUEST``
   (counted as malformed).
3. With CURVE roles, a request's ``cid`` must be its sender's identity (the dedup
   record is keyed by the authenticated sender), but for the broker's own requests
   (an identity starting with a zero byte, which no peer's can): ``BAD_REQUEST``.
4. While the replies held for the link the request came by leave no room for another
   full message (:func:`link_full`): ``OVERLOADED`` (counted), so the reply to every
   request taken fits.
5. Without a running lease from the broker: ``NOT_PRIMARY``.
6. A write with ``acks="all"`` while fewer copies are in sync than it needs:
   ``NOT_ENOUGH_REPLICAS``.
7. Otherwise it runs.  A client that asks for a reply in two parts (``er``) gets one
   when its writes' answer waits (for the log, or with ``acks="all"`` for replicas).

Rules after the core ran (:func:`plan`):

8. A reply to a request that changed nothing goes at once, but:

   a. one larger than ``max_message_bytes`` less 4 KiB is replaced by ``BAD_REQUEST``
      naming the limit (the broker would cut the shard's connection for it);
   b. one that answers a re-sent write from the dedup record goes no sooner than its
      first copy may have: once the log holds the current LSN and, with
      ``acks="all"``, the replicas required do;
   c. one that answers a write while the log lags the current LSN goes once it holds it.

   The answers it carries (``acked``) are held again when it is replaced (a) or
   answers a re-sent write (b: it may wait long, and be refused).
9. A request that changed state is replicated and logged; its answer goes once the log
   holds it and, with ``acks="all"``, every replica required has it.  A reply in two
   parts sends the first (the reads) at once; the final one of a request whose writes
   are all background pushes (``lz``) with ``acks="all"`` is held (:class:`HeldAcks`)
   for the client's next reply that goes at once to carry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from zps.protocol.codec import CODEC_RAW, MsgType
from zps.protocol.messages import Status, StatusReply
from zps.protocol.ops import PUSHES
from zps.shard.core import MUTATIONS, Handled

#: How many answers to a client's background writes may be held for its next reply to
#: carry (for how long: ``shard.ack_hold_s``).
ACK_HOLD_MAX = 64
#: Clients remembered as waiting (their last request was not lazy): nothing is held
#: for them.  Past this many the set starts again (a forgotten one waits ack_hold_s).
ACK_HOLD_CLIENTS = 4096
#: A reply this close to ``max_message_bytes`` is refused (rule 8a): room for routing.
REPLY_MARGIN = 4096
#: Item sizes of the gradient dtypes checked finite as they are read (see grad_frames).
FLOAT_SIZES = {"float32": 4, "float64": 8}


class Lease(Protocol):
    """What the rules ask of the shard's session (:class:`~zps.shard.session.ShardSession`
    has it), each only once the rules before it passed."""

    def may_write(self, now: float) -> bool: ...

    def enough_in_sync(self) -> bool: ...

    def short_of_copies(self) -> str: ...

    @property
    def replicas_required(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Policy:
    """What the rules take from the shard's configuration."""

    node_id: str
    #: CURVE roles are on: a request's ``cid`` must be its sender's (rule 3).
    roles: bool
    reply_queue_bytes: int
    max_message_bytes: int


class Count(enum.Enum):
    """The shard statistic a refusal counts in."""

    MALFORMED = "malformed"
    OVERLOADED = "overloaded"


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer ``status`` with ``message`` and run nothing; ``count``: the statistic it
    counts in (None: none); ``extra``: more header keys (a shared-memory refusal's)."""

    status: Status
    message: str
    count: Count | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    def header(self) -> dict[str, Any]:
        h = StatusReply(self.status, self.message).to_wire()
        h.update(self.extra)
        return h


@dataclass(frozen=True, slots=True)
class Admit:
    """Run the request."""

    #: It holds an operation that changes state.
    mutates: bool
    #: ``acks=1``: its writes' answer waits for the log only, not for replicas.
    acks_1: bool
    #: Its reply comes in two parts: the reads at once, the writes when held (rule 7).
    split: bool
    #: Its writes are all background pushes (``lz``): their answer may be held (rule 9).
    lazy: bool


Verdict: TypeAlias = Admit | Refuse
_REQUEST = MsgType.REQUEST

#: Every Admit there is, by (mutates, acks_1, split, lazy): none is made per request.
_ADMITS = {
    (m, a, s, lz): Admit(m, a, s, lz)
    for m in (False, True)
    for a in (False, True)
    for s in (False, True)
    for lz in (False, True)
}


def mutates(header: dict[str, Any]) -> bool:
    """Whether a request holds an operation that changes state."""
    ops = header.get("ops")
    if not isinstance(ops, list):
        return False
    for op in ops:  # a loop, not any() over a generator: every request asks
        if isinstance(op, dict):
            name = op.get("op")
            if isinstance(name, str) and name in MUTATIONS:
                return True
    return False


def grad_frames(header: dict[str, Any]) -> dict[int, str]:
    """Payload index -> dtype of the raw float gradients of a request's pushes: read from
    a client's shared memory, they are checked finite in the same pass.  A payload some
    operation names otherwise (another dtype or codec) is left out: the verdict must
    hold for every reading of those bytes (see ShardCore._known_finite)."""
    found: dict[int, str] = {}
    mixed: set[int] = set()
    ops = header.get("ops")
    if not isinstance(ops, list):
        return found
    for op in ops:
        if not isinstance(op, dict):
            continue
        name = op.get("op")
        push = isinstance(name, str) and name in PUSHES
        for key, g in op.items():  # every array the operation names
            if not (isinstance(g, list) and len(g) == 4 and type(g[0]) is int):
                continue
            if (
                push
                and key == "g"
                and g[3] == CODEC_RAW
                and type(g[1]) is str
                and g[1] in FLOAT_SIZES
                and found.get(g[0], g[1]) == g[1]
            ):
                found[g[0]] = g[1]
            else:
                mixed.add(g[0])
    for i in mixed:
        found.pop(i, None)
    return found


def link_full(held_bytes: int, policy: Policy) -> bool:
    """Too much is held for a link to take a request whose reply may be a full message
    (rule 4)."""
    return held_bytes > 0 and held_bytes + policy.max_message_bytes > policy.reply_queue_bytes


def shm_refusal(
    error: str, *, busy: bool, permanent: bool, token: int | None, policy: Policy
) -> Refuse:
    """Rule 1: a client's shared memory could not be read (the client sends again)."""
    extra: list[tuple[str, Any]] = [
        # busy: out of descriptors or memory here, for a while (the client offers
        # shared memory again later); open: never; gone: not these regions.
        ("noshm", "busy" if busy else "open" if permanent else "gone"),
        ("by", policy.node_id),
    ]
    if token is not None:  # which region: a late refusal is told from a new one
        extra.append(("tok", [token]))
    return Refuse(Status.OVERLOADED, f"shard {policy.node_id}: {error}", None, tuple(extra))


def malformed(error: str) -> Refuse:
    """Rule 2: a message that does not decode."""
    return Refuse(Status.BAD_REQUEST, error, Count.MALFORMED)


def overloaded(policy: Policy, link: str = "the broker") -> Refuse:
    """Rule 4 for the link to ``link``."""
    return Refuse(
        Status.OVERLOADED,
        f"shard {policy.node_id}: replies held for {link} fill "
        f"shard.reply_queue_bytes ({policy.reply_queue_bytes}); retry later",
        Count.OVERLOADED,
    )


#: A request routed by a broker of a pair that was replaced: the client retries.
REPLACED = Refuse(Status.NOT_PRIMARY, "routed by a broker that was replaced")


def admit(
    source: bytes,
    mtype: MsgType,
    header: dict[str, Any],
    writes: bool,
    policy: Policy,
    lease: Lease,
    held_bytes: int,
    log_waits: bool,
    now: float,
) -> Verdict:
    """Rules 2 to 7 for a request that decoded (``header``) from client ``source``;
    ``writes``: it holds a mutation (:func:`mutates`); ``held_bytes``: what is held for
    the link it came by (rule 4, :func:`link_full`); ``log_waits``: answers to writes
    wait for the log.  An admitted request's verdict is one of a few shared
    :class:`Admit` records (none is made per request)."""
    if mtype is not _REQUEST:
        return Refuse(
            Status.BAD_REQUEST, f"a shard serves REQUEST, not {mtype.name}", Count.MALFORMED
        )
    get = header.get
    if policy.roles and get("cid", source) != source and not source.startswith(b"\0"):
        # Dedup is keyed by the authenticated sender: no client may use (or poison)
        # another's sequence numbers.
        return Refuse(
            Status.BAD_REQUEST, "a request's 'cid' must be its sender's identity", Count.MALFORMED
        )
    if held_bytes > 0 and held_bytes + policy.max_message_bytes > policy.reply_queue_bytes:
        return overloaded(policy)  # link_full(held_bytes, policy), inline: every request
    if not lease.may_write(now):
        return Refuse(Status.NOT_PRIMARY, "the primary's lease from the broker has run out")
    acks_1 = get("acks") == 1
    if writes and not acks_1 and not lease.enough_in_sync():
        return Refuse(Status.NOT_ENOUGH_REPLICAS, lease.short_of_copies())
    split = get("er") == 1 and (log_waits or (not acks_1 and lease.replicas_required))
    return _ADMITS[writes, acks_1, split, get("lz") == 1]


class Wait(enum.Enum):
    """When a reply goes."""

    #: At once.
    NOW = "now"
    #: Once the log holds the LSN it was planned at.
    LOG = "log"
    #: Once the log holds it, then every replica required (a write's answer, acks="all").
    REPLICAS = "replicas"


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    """How the reply to an admitted request goes (rules 8 and 9)."""

    #: When the reply (the final part, for a reply in two parts) goes.
    wait: Wait
    #: The request changed state: stream it to the replicas and log it first.
    replicate: bool = False
    #: Rule 8a: answer ``BAD_REQUEST`` with this message instead (counted as an error).
    too_large: str | None = None
    #: The answers the reply was to carry did not go with it: hold them again.
    give_back: bool = False
    #: Rule 9: the reply returned is the first part, sent at once; the final part is
    #: ``{"st": "OK", "res": writes_res}``.
    first_part: bool = False
    #: Rule 9: the final part is a background write's answer: held (HeldAcks.hold).
    hold_final: bool = False


#: The plan of a reply that goes at once with nothing else to do (most requests that
#: changed nothing): the one record :func:`plan` returns for it, so the driver may
#: tell it by identity and skip the rest of the plan.
NOW = ReplyPlan(Wait.NOW)
#: The plan of a request that changed state, by (acks_1, first_part, hold_final): none is
#: made per request.
_CHANGED = {
    (acks_1, first, hold): ReplyPlan(
        Wait.LOG if acks_1 else Wait.REPLICAS, replicate=True, first_part=first, hold_final=hold
    )
    for acks_1 in (False, True)
    for first in (False, True)
    for hold in (False, True)
}


def plan(
    admitted: Admit,
    done: Handled,
    reply_bytes: int,
    log_behind: bool,
    policy: Policy,
) -> ReplyPlan:
    """Rules 8 and 9 for what the core did (``done``) with an admitted request;
    ``reply_bytes``: the reply's size as it would be sent (read only for a request that
    changed nothing); ``log_behind``: answers wait for the log and it does not yet hold
    the current LSN.  Every plan but rule 8a's and a give-back is a shared record
    (:data:`NOW` for a reply that goes at once)."""
    if done.changed:
        first = done.writes_res is not None
        acks_1 = admitted.acks_1
        return _CHANGED[acks_1, first, first and admitted.lazy and not acks_1]
    fits = reply_bytes <= policy.max_message_bytes - REPLY_MARGIN
    if fits and not (admitted.mutates and (done.duplicate or log_behind)):
        return NOW
    too_large = None
    if not fits:
        too_large = (
            f"the reply would be {reply_bytes} bytes, over shard.max_message_bytes "
            f"({policy.max_message_bytes}); ask for less per request"
        )
    resent = done.duplicate and admitted.mutates
    if resent:
        wait = Wait.LOG if admitted.acks_1 else Wait.REPLICAS
    elif log_behind and admitted.mutates:
        wait = Wait.LOG
    else:
        wait = Wait.NOW
    give_back = done.carried and (too_large is not None or resent)
    return ReplyPlan(wait, too_large=too_large, give_back=give_back)


class HeldAcks:
    """Answers to clients' background writes (``lz``), released by the replicas, held
    for the client's next reply that goes at once to carry (``acked``), or sent on their
    own after ``hold_s`` (the driver's timer): a pipelined step costs one reply, not two.
    A client whose last request was not lazy waits (``flush()``): nothing is held for it.
    """

    def __init__(
        self, hold_s: float, *, max_held: int = ACK_HOLD_MAX, max_clients: int = ACK_HOLD_CLIENTS
    ) -> None:
        self.hold_s = hold_s
        self.max_held = max_held
        self.max_clients = max_clients
        self._held: dict[bytes, list[list[Any]]] = {}
        self._eager: set[bytes] = set()

    def seen(self, client: bytes, lazy: bool) -> None:
        """An admitted request of ``client``: lazy or not (it waits for its answers)."""
        if lazy:
            self._eager.discard(client)
        elif client not in self._eager:
            if len(self._eager) >= self.max_clients:
                self._eager.clear()  # clients come and go: forget the oldest word
            self._eager.add(client)

    def take(self, client: bytes, lazy: bool) -> list[list[Any]] | None:
        """:meth:`seen` and :meth:`carry` in one call (the request path's)."""
        if lazy:
            self._eager.discard(client)
        elif client not in self._eager:
            if len(self._eager) >= self.max_clients:
                self._eager.clear()
            self._eager.add(client)
        return self._held.get(client)

    def waiting(self, client: bytes) -> bool:
        """Whether ``client`` waits for its answers (its last request was not lazy)."""
        return client in self._eager

    def carry(self, client: bytes) -> list[list[Any]] | None:
        """What the next reply to ``client`` may carry (``[req_id, statuses]`` pairs)."""
        return self._held.get(client)

    def carried(self, client: bytes) -> None:
        """The reply took what :meth:`carry` gave."""
        del self._held[client]

    def give_back(self, client: bytes, acks: list[list[Any]]) -> None:
        """Answers a reply took but did not send: held again, before any held since."""
        self._held[client] = acks + self._held.get(client, [])

    def hold(self, client: bytes, req_id: int, res: list[Any]) -> list[list[Any]] | None:
        """Hold the answer to request ``req_id``; returns what must go at once instead
        (no holding, a waiting client, or too many held), else None (the driver's timer
        sends it after ``hold_s``)."""
        held = self._held.setdefault(client, [])
        held.append([req_id, res])
        if self.hold_s <= 0 or client in self._eager or len(held) >= self.max_held:
            return self._held.pop(client)
        return None

    def release(self) -> dict[bytes, list[list[Any]]]:
        """Everything held (the timer went off)."""
        held, self._held = self._held, {}
        return held

    def __len__(self) -> int:
        return len(self._held)
