"""A client's side of the same-host shared-memory path (:mod:`zps.shm`) for its
requests: which requests' payloads go through it and to which primaries, the regions
each names until it is answered, the replies read out of a shard's memory, and the
shards' refusals (``noshm``: ``gone``, ``open``, ``busy``).

It needs the client's clock and, per partition, the primary its map names: nothing
else of the connection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zps import shm
from zps.client.ops import Op, Token
from zps.client.session import Action, Deliver, Fail, Resubmit, Send
from zps.errors import ProtocolError
from zps.protocol.codec import Message, unpack_route

log = logging.getLogger("zps.client")


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, as a flat uint8 view (for :meth:`shm.Mapper.read`)."""
    return a.reshape(-1).view(np.uint8)


def _places(ops: list[Op], header: dict[str, Any]) -> dict[int, np.ndarray] | None:
    """Where a reply's payload frames go, by frame: the i-th array of an operation's
    result to its i-th place (``Op.into``), while the operation's call still waits for
    it.  What the reply names otherwise (or a frame of another length, see
    :meth:`shm.SharedMemory.inbound`) gets a fresh array."""
    results = header.get("res")
    if not isinstance(results, list) or len(results) != len(ops):
        return None
    into: dict[int, np.ndarray] = {}
    for op, res in zip(ops, results, strict=True):
        if op.into is None or op.future.done():  # a call cancelled or failed: not its places
            continue
        descs = res.get("a") if isinstance(res, dict) else None
        if not isinstance(descs, list):
            continue
        for desc, place in zip(descs, op.into, strict=False):
            if isinstance(desc, list) and desc and type(desc[0]) is int:
                into.setdefault(desc[0], _bytes_of(place))
    return into or None


@dataclass(slots=True)
class ShmRequest:
    """A request with frames large enough for shared memory (:mod:`zps.shm`)."""

    token: list[Op]
    reply_ok: bool  # its reply may come through the shard's shared memory
    #: Its payloads' regions, taken by its first sending through shared memory and
    #: named again by every re-send (freeing them while a copy of the request may still
    #: be queued for a shard would make that copy fail, and its retry the next one).
    regions: list[list[int]] = field(default_factory=list)
    #: A shard refused to open its payloads (``noshm: open`` or ``busy``): its re-sends go inline,
    #: whichever shard the client's map names (a stale map may name another).
    inline: bool = False


class ClientShm:
    """The path's state for one client (see the module notes); ``memory`` is None when
    the path is off, and then every frame goes inline."""

    def __init__(
        self,
        memory: shm.SharedMemory | None,
        *,
        now: Callable[[], float],
        primary_of: Callable[[int], str | None],
    ) -> None:
        self.memory = memory
        self._now = now
        self._primary_of = primary_of
        self.requests: dict[int, ShmRequest] = {}  # by request id
        self._done: dict[int, list[int]] = {}  # reply regions read, told per partition
        #: Primaries that cannot open this client's memory, with the time until which
        #: they get inline frames (inf: for good; see refusal).
        self.refused: dict[str, float] = {}
        #: Until when replies come inline: 0 while this client can open the shards'
        #: memory, inf when it never can (its path off, or a failure for good).
        self.replies_off = 0.0 if memory is not None else math.inf

    def large(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` would go through shared memory."""
        return self.memory is not None and nbytes >= self.memory.min_bytes

    def track(self, ops: list[Op], actions: Iterable[Action[Token]]) -> None:
        """The sends of a request of ``ops`` just submitted: tracked if any payload is
        large enough (its reply may come this way if large enough too)."""
        if self.memory is None or not any(self.large(op.nbytes) for op in ops):
            return
        reply_ok = self.large(sum(op.reply_bytes for op in ops))
        for a in actions:
            if isinstance(a, Send) and a.req_id:
                self.requests[a.req_id] = ShmRequest(ops, reply_ok)

    def buffer(self, shape: tuple[int, ...], dtype: str) -> np.ndarray | None:
        """Zeros in shared memory (:meth:`shm.SharedMemory.buffer`), or None: no room."""
        if self.memory is None or math.prod(shape) * np.dtype(dtype).itemsize <= 0:
            return None
        return self.memory.buffer(shape, dtype)

    def stage(self, arr: np.ndarray) -> np.ndarray | None:
        """A copy of ``arr`` in shared memory if it is large enough and there is room."""
        if self.memory is None or arr.nbytes < self.memory.min_bytes:
            return None
        return self.memory.stage(arr)

    def detach(self, req_ids: Sequence[int]) -> None:
        """These requests' frames were copied (the caller takes its memory back): the
        regions they named go, and so do those of every request naming a buffer region
        they named (each takes new ones when sent again)."""
        memory = self.memory
        buffers: set[int] = set()  # tokens of buffer regions the detached requests named
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            buffers.update(d[6] for d in req.regions if len(d) == 8)
            if memory is not None:
                memory.free(shm.tokens(req.regions))
            req.regions = []
        if buffers and memory is not None:
            for req in self.requests.values():
                if any(d[6] in buffers for d in req.regions):
                    memory.free(shm.tokens(req.regions))
                    req.regions = []

    def housekeeping(self) -> None:
        if self.memory is not None:  # unmap the memory of shards that are gone
            self.memory.housekeeping()

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()

    def frames(self, send: Send) -> list[Any]:
        """A request's frames with its large payloads in shared memory, unless its
        partition's primary could not open them."""
        assert self.memory is not None
        req = self.requests[send.req_id]
        partition = unpack_route(send.frames[0]).partition
        to_primary = self.to(partition) and not req.inline
        if 0 < self.replies_off <= self._now():
            self.replies_off = 0.0  # a while has passed since it could not: try again
        frames, descs = self.memory.outbound(
            send.frames,
            payloads=to_primary,
            reuse=req.regions,
            reply_ok=req.reply_ok and not self.replies_off and to_primary,
            done=self._done.pop(partition, ()),
        )
        if descs and not req.regions:
            req.regions = descs
        return frames

    def to(self, partition: int) -> bool:
        """Whether the partition's primary is known and has not said that it cannot
        share memory with this client (another host or user, or its path off)."""
        primary = self._primary_of(partition)
        if primary is None:
            return False
        until = self.refused.get(primary)
        if until is None:
            return True
        if self._now() < until:
            return False
        del self.refused[primary]  # it could not for a while: offer it again
        return True

    def finished(self, action: Deliver[Token] | Fail[Token] | Resubmit[Token]) -> None:
        """A request is over: the regions of its payloads may be reused."""
        assert self.memory is not None
        if isinstance(action, Deliver):
            req = self.requests.pop(action.msg.route.req_id, None)
        elif isinstance(action, Resubmit):
            req = self.requests.pop(action.req_id, None)
        else:
            req_id = next((r for r, q in self.requests.items() if q.token is action.token), None)
            req = None if req_id is None else self.requests.pop(req_id)
        if req is not None:
            self.memory.free(shm.tokens(req.regions))

    def reply(self, bufs: list[Any], msg: Message) -> Message:
        """A reply whose large frames are in the shard's shared memory, copied here.  A
        region that cannot be read makes it a refusal: the session asks again (inline,
        if this client cannot open the shard's memory at all)."""
        info = msg.header.get(shm.KEY)
        descs = info.get("d") if isinstance(info, dict) else None
        tokens = [d[6] for d in descs if isinstance(d, list) and len(d) == 7] if descs else []
        if tokens:  # the shard may reuse them: told with the next request to the partition
            done = self._done.setdefault(msg.route.partition, [])
            done.extend(tokens)
            del done[:-256]
        if self.memory is None:
            raise ProtocolError("a reply in shared memory, which this client did not ask for")
        # Operations that name where their arrays go (a pulled tensor's pieces), alone
        # or sharing the request with others (a pipelined push and the next pull).
        # Only while the request is unanswered (the entry goes with its answer), so a
        # late duplicate never writes into an array already handed back.
        req = self.requests.get(msg.route.req_id)
        into = _places(req.token, msg.header) if req is not None else None
        try:
            got = self.memory.inbound(bufs, msg.header, into, header_frame=False)
        except shm.ShmUnavailableError as e:
            if e.permanent:
                until = self._now() + shm.RETRY_S if e.busy else math.inf
                self.replies_off = max(self.replies_off, until)
            log.warning("re-sending request %d: %s", msg.route.req_id, e)
            refused: dict[str, Any] = {"st": "OVERLOADED", "msg": str(e)}
            if "acked" in msg.header:  # earlier requests' answers still count
                refused["acked"] = msg.header["acked"]
            return Message(msg.route, refused, [])
        return Message(msg.route, got.header, got.frames[2:])

    def refusal(self, msg: Message) -> None:
        """A primary could not read this client's shared memory: at all (``open``: it
        gets inline frames, and answers inline, from now on; also said on an answer to
        a request that asked for its reply this way), or these regions (``gone``: the
        next sending takes new ones)."""
        req = self.requests.get(msg.route.req_id)
        if msg.header.get("noshm") == "gone":
            if req is None or self.memory is None:
                return
            named = msg.header.get("tok")
            current = shm.tokens(req.regions)
            if isinstance(named, list) and not set(named) & set(current):
                # A refusal of an earlier sending's regions (freed since, and the
                # request sent again with new ones, which the shard may be reading now).
                return
            self.memory.free(current)
            req.regions = []
            return
        if req is not None and msg.header.get("st") == "OVERLOADED":
            # Sent again inline: to the shard that refused, or to the one a newer map
            # names, which then answers STALE_EPOCH and the map is asked for again.
            req.inline = True
        by = msg.header.get("by")  # the shard that said so (earlier releases: not told)
        if not isinstance(by, str):
            by = self._primary_of(msg.route.partition)
        if by is None:
            return
        now = self._now()
        if msg.header.get("noshm") == "busy":  # out of descriptors or memory: for a while
            if self.refused.get(by, 0.0) <= now:
                log.warning(
                    "shard %s cannot open this client's shared memory for now (%s): "
                    "inline frames for %.0f s",
                    by,
                    msg.header.get("msg", "?"),
                    shm.RETRY_S,
                )
            self.refused[by] = max(self.refused.get(by, 0.0), now + shm.RETRY_S)
        elif self.refused.get(by) != math.inf:
            log.info("shard %s cannot share memory with this client", by)
            self.refused[by] = math.inf
