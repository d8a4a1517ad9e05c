"""One operation of a client's call as the request pipeline carries it (:class:`Op`):
merged with others of its kind, copied when the caller takes its memory back, its
result read from a reply, submitted again (whole, or split by a new map after
``MOVED``) and failed."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zps.client.futures import join_moved, pass_on, split_result
from zps.core.batching import merge_row_ops
from zps.errors import ClosedError, ProtocolError, RemoteError, remote_error
from zps.protocol.codec import array_from
from zps.protocol.ops import MERGEABLE

if TYPE_CHECKING:
    from zps.client.session import Deliver, Resubmit


@dataclass(slots=True)
class Op:
    body: dict[str, Any]
    arrays: dict[str, np.ndarray]
    future: asyncio.Future[dict[str, Any]]
    reply_bytes: int = 0  # the array bytes the reply will carry
    partition: int = -1  # where it was last sent (an answer MOVED re-sends it)
    #: Where the caller wants the reply's arrays, in order (a pulled tensor's pieces):
    #: those that come through shared memory are copied there directly.
    into: list[np.ndarray] | None = None
    #: Its arrays are the caller's memory, for as long as the call waits: sent inline,
    #: their frames are copies (zmq may read a frame after the call ended: _transmit).
    borrowed: bool = False
    #: A background push (``wait=False``): no caller waits for its answer, which may
    #: then ride on a later reply (see ClientSession, rule 7).
    lazy: bool = False
    #: When its caller's wait ends, once it was submitted again (ClientSession, rule 8):
    #: every later request of it keeps that deadline.
    deadline: float | None = None
    #: The operation's cost: the larger of its request and its reply payload (read
    #: several times per request, so computed once).
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        size = 0
        for a in self.arrays.values():
            size += a.nbytes
        self.nbytes = max(size, self.reply_bytes)


def copy_shared(frames: list[Any], arr: np.ndarray | None, *, start: int) -> bool:
    """Replace the frames from ``start`` on that share ``arr``'s memory (None: any
    array's) with copies of their bytes; whether any did (``bytes`` frames are copies
    already)."""
    shared = False
    for i in range(start, len(frames)):
        f = frames[i]
        if (
            isinstance(f, memoryview | np.ndarray)
            and f.nbytes
            and (arr is None or np.may_share_memory(f, arr))
        ):
            frames[i] = bytes(f)
            shared = True
    return shared


def copy_arrays(op: Op, arr: np.ndarray) -> None:
    for key, a in op.arrays.items():
        if np.may_share_memory(a, arr):
            op.arrays[key] = a.copy()


#: What the session hands back for a request: its operations, or a broker call's future.
Token = list[Op] | asyncio.Future[dict[str, Any]]


def copy_everywhere(
    arr: np.ndarray,
    in_flight: Iterable[tuple[int, Any, list[Any]]],
    held_back: Iterable[tuple[Any, list[Any]]],
    queued: Iterable[list[Op]],
) -> list[int]:
    """Whatever may still be sent of ``arr`` (the caller's memory, which the caller may
    write from now on) becomes a copy of the bytes it holds now: the frames requests in
    flight are re-sent with and their operations (which a ``MOVED`` answer splits and
    sends anew), sends held back (their frames from the third on) and operations not
    yet sent.  The requests in flight whose frames shared its memory."""
    copied = []
    for req_id, token, body in in_flight:
        if copy_shared(body, arr, start=1):
            copied.append(req_id)
        for op in token if isinstance(token, list) else ():
            copy_arrays(op, arr)
    for _, frames in held_back:
        copy_shared(frames, arr, start=2)
    for ops in queued:
        for op in ops:
            copy_arrays(op, arr)
    return copied


def merge(ops: list[Op], *, max_ops: int, max_bytes: int) -> list[Op]:
    """Row operations on one table become one operation (see batching.merge_row_ops), of
    at most ``max_ops`` operations and ``max_bytes``; each merged one's future hands each
    original operation its part."""
    if len(ops) < 2:
        return ops
    keys: set[tuple[Any, ...]] = set()
    for op in ops:  # the common case: no two row operations of a kind on one table
        body = op.body
        name = body.get("op")
        if name in MERGEABLE:
            key = (name, body.get("t"), body.get("step"))
            if key in keys:
                break
            keys.add(key)
    else:
        return ops
    out = []
    loop = asyncio.get_running_loop()
    merged = merge_row_ops(
        [(op.body, op.arrays) for op in ops],
        max_ops,
        sizes=[op.nbytes for op in ops],
        max_bytes=max_bytes,
    )
    for m in merged:
        if len(m.parts) == 1:
            out.append(ops[m.parts[0][0]])
            continue
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        members = [(ops[i].future, a, b) for i, a, b in m.parts]
        fut.add_done_callback(functools.partial(split_result, members=members))
        reply = sum(ops[i].reply_bytes for i, _, _ in m.parts)
        lazy = all(ops[i].lazy for i, _, _ in m.parts)
        # Submitted again (ClientSession, rule 8), an operation keeps its deadline: the
        # merged one ends at the earliest of its members'.
        deadlines = [d for i, _, _ in m.parts if (d := ops[i].deadline) is not None]
        out.append(
            Op(m.body, m.arrays, fut, reply, lazy=lazy, deadline=min(deadlines, default=None))
        )
    return out


def result(res: object, payloads: Sequence[Any], max_bytes: int) -> dict[str, Any]:
    """An operation's result in a reply (its arrays, of at most ``max_bytes``, read from the
    reply's ``payloads``); raises the error it names."""
    if not isinstance(res, dict):
        raise ProtocolError("operation result is not a map")
    st = res.get("st")
    if st != "OK":
        raise remote_error(str(st), str(res.get("msg", "")))
    desc = res.get("a")
    if desc is not None:
        limit = max_bytes
        if isinstance(desc, list) and desc and isinstance(desc[0], list):
            res["arrays"] = [array_from(d, payloads, max_bytes=limit) for d in desc]
        else:
            res["arrays"] = array_from(desc, payloads, max_bytes=limit)
    return res


def again(op: Op, partition: int, submit: Callable[..., asyncio.Future[dict[str, Any]]]) -> None:
    """Submit ``op`` again, whole, to ``partition`` as a new request (ClientSession, rules 8
    and 9), its outcome handed to its caller."""
    try:
        fut = submit(
            partition,
            op.body,
            op.arrays,
            reply_bytes=op.reply_bytes,
            into=op.into,
            borrowed=op.borrowed,
            lazy=op.lazy,
            deadline=op.deadline,
        )
    except ClosedError as e:
        op.future.set_exception(e)
        return
    fut.add_done_callback(functools.partial(pass_on, target=op.future))


def deliver(
    ops: list[Op],
    action: Deliver[Any],
    *,
    submit: Callable[..., asyncio.Future[dict[str, Any]]],
    max_bytes: int,
) -> None:
    """Each operation's result in the reply ``action.msg``; a ``partial`` reply has one only
    for each read (the writes wait for the final reply).  The operations the session names
    in ``action.again`` are submitted again (:func:`again`)."""
    msg = action.msg
    results = msg.header.get("res")
    if not isinstance(results, list) or len(results) != len(ops):
        err = ProtocolError("reply does not match the request's operations")
        for op in ops:
            if not op.future.done():
                op.future.set_exception(err)
        return
    resent = action.again
    for i in resent:
        if not ops[i].future.done():
            again(ops[i], msg.route.partition, submit)
    partial = action.partial
    for i, (op, res) in enumerate(zip(ops, results, strict=True)):
        if op.future.done() or (partial and res is None) or (resent and i in resent):
            continue
        try:
            op.future.set_result(result(res, msg.payloads, max_bytes))
        except (ProtocolError, RemoteError) as e:
            op.future.set_exception(e)


def resubmit(
    ops: list[Op], action: Resubmit[Any], submit: Callable[..., asyncio.Future[dict[str, Any]]]
) -> None:
    """Submit anew, as the session planned (ClientSession, rule 8), each operation of a
    request refused ``MOVED`` whose caller still waits: whole where it was going (not on
    a slot: tables, describe...), else in the pieces of the new map, joined into the
    operation's future."""
    for op, plan in zip(ops, action.plans, strict=True):
        if op.future.done():
            continue
        op.deadline = action.deadline
        if plan is None:
            again(op, action.partition, submit)
            continue
        pieces = [
            submit(
                p, b, a, reply_bytes=r, borrowed=op.borrowed, lazy=op.lazy, deadline=action.deadline
            )
            for p, b, a, r in plan.pieces
        ]
        joined = asyncio.gather(*pieces)
        joined.add_done_callback(functools.partial(join_moved, target=op.future, plan=plan))


def fail(token: list[Op] | asyncio.Future[dict[str, Any]], error: BaseException) -> None:
    """Every caller still waiting on ``token`` (a request's operations, or a broker
    call's future) gets ``error``."""
    for fut in [op.future for op in token] if isinstance(token, list) else [token]:
        if not fut.done():
            fut.set_exception(error)


class Resubmits:
    """What a ``MOVED`` answer sends again (ClientSession, rule 8): at once, or, refused
    again under the same map (``Resubmit.after``), held back until a newer map comes
    (:meth:`new_map`) or its time is up, then submitted as planned (:func:`resubmit`).
    :meth:`fail` ends what is held (the client closed)."""

    def __init__(
        self,
        submit: Callable[..., asyncio.Future[dict[str, Any]]],
        call_later: Callable[[float, Callable[[], None]], object],
    ) -> None:
        self._submit = submit
        self._call_later = call_later
        self._held: dict[int, tuple[list[Op], Resubmit[Any]]] = {}
        self._keys = itertools.count()

    def __len__(self) -> int:
        return len(self._held)

    def resubmit(self, ops: list[Op], action: Resubmit[Any]) -> None:
        if action.after <= 0:
            resubmit(ops, action, self._submit)
            return
        key = next(self._keys)
        self._held[key] = (ops, action)
        self._call_later(action.after, functools.partial(self._due, key))

    def _due(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            resubmit(*held, self._submit)

    def new_map(self) -> None:
        """A newer map came: what is held goes now (split by the map it was refused
        under; refused again, it is split by the new one)."""
        held, self._held = self._held, {}
        for ops, action in held.values():
            resubmit(ops, action, self._submit)

    def fail(self, error: BaseException) -> None:
        held, self._held = self._held, {}
        for ops, _ in held.values():
            fail(ops, error)
