"""Which messages the broker takes at all: CURVE roles, other protocol versions,
malformed messages.

One job: with CURVE key roles, a sender's key must be allowed, own the identity it
uses (a shard name is bound to the key it first came with) and, for a command that
changes the cluster, be an operator's (:mod:`zps.ops.security` holds the rules);
a message in another protocol version is answered ``VERSION_MISMATCH``; a malformed
one is counted and dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from zps import transport
from zps.broker.base import BrokerStats
from zps.core.cluster import ClusterState
from zps.core.membership import is_liveness
from zps.errors import ProtocolError
from zps.ops.security import (
    ADMIN_FIELDS,
    KeyRoles,
    RefusalLog,
    identity_refusal,
    is_shard_identity,
    refused_by_role,
    request_refusal,
)
from zps.protocol.codec import (
    PROTOCOL_VERSION,
    MsgType,
    Route,
    VersionMismatchError,
    decode,
    encode,
    unpack_route,
)
from zps.protocol.messages import Status, StatusReply, StatusRequest, TaskRequest
from zps.version import __version__

log = logging.getLogger("zps.broker")

#: Shard names bound to keys at most (past it a name no live shard holds is forgotten).
_MAX_BOUND_NAMES = 65536


#: Said of a refused handshake that presented this broker's own key.
OWN_KEY_REFUSED = (
    "the broker's own key: its pair peer's or a routing broker's; put it in "
    "allowed_clients_dir (docs/deploy.md, section 8)"
)


class Admission:
    """CURVE roles, version mismatches, malformed messages (see the module notes).

    ``state`` is the broker's current one (a broker of a pair gets a new one when it
    resets); ``bound_keys`` (shard name -> CURVE key) is shared with the record;
    ``roles``, ``own_key``, ``sock`` and ``out`` are set once the socket is bound."""

    def __init__(
        self,
        state: ClusterState,
        stats: BrokerStats,
        refusals: RefusalLog,
        bound_keys: dict[str, bytes],
        *,
        post: Callable[[list[Any]], object],
        refuse: Callable[[bytes, Route, Status, str], None],
        refuse_call: Callable[[bytes, Route, str], None],
        state_changed: Callable[[], None],
    ) -> None:
        self.state = state
        self.stats = stats
        self.refusals = refusals
        self.bound_keys = bound_keys
        self._post = post
        self._refuse = refuse
        self._refuse_call = refuse_call
        self._state_changed = state_changed
        self.roles: KeyRoles | None = None
        self.own_key: bytes | None = None  # this broker's public key (CURVE)
        self.sock: transport.Channel | None = None
        self.out: transport.Outbound | None = None
        self._mismatched: set[str] = set()  # peers warned about another protocol version

    def authorised(self, ident: bytes, node: str, frames: transport.Frames) -> bool:
        """CURVE: the sender's key must be allowed, own the identity (a shard name is
        bound to the key it first came with, any other identity carries its key's tag:
        zps.ops.security) and, for a command that changes the cluster, be an operator's.
        Anything else is dropped (a command refused with an answer), counted by reason
        and logged once per peer and key a minute."""
        assert self.roles is not None
        key = transport.sender_key(frames[1])
        shard = is_shard_identity(ident)
        owner = self.bound_keys.get(node) if shard else None
        reason = identity_refusal(ident, key, self.roles, owner)
        if reason is None and self.sock is not None:
            self.sock.accepted(frames)  # its key owns the identity: answers go this way
        if reason is None and shard and owner is None:
            assert key is not None
            self._bind(node, key)
        if reason is None and not shard:
            refused = self._command_refusal(ident, frames, "operator" in self.roles.roles(key))
            if refused is not None:  # counted and logged before it is answered
                self.stats.unauthorized += 1
                self.refusals.refused(node, key, refused[0], time.monotonic(), refused[1])
                refused[2]()
                return False
        if reason is None:
            return True
        self.stats.unauthorized += 1
        self.refusals.refused(node, key, reason, time.monotonic())
        return False

    def connection_closed(self, fd: int) -> None:
        """CURVE: a connection closed; its identity gets nothing until it speaks again
        (whatever connection holds the identity next may be another key's)."""
        if self.out is not None:
            self.out.connection_closed(fd)

    def _bind(self, node: str, key: bytes) -> None:
        """Bind shard name ``node`` to ``key``.  The table is bounded: past its bound a
        name no shard of the membership holds is forgotten (never a live one)."""
        if len(self.bound_keys) >= _MAX_BOUND_NAMES:
            idle = next((n for n in self.bound_keys if n not in self.state.shards), None)
            if idle is not None:
                del self.bound_keys[idle]
        self.bound_keys[node] = key
        self._state_changed()

    def _command_refusal(
        self, ident: bytes, frames: transport.Frames, operator: bool
    ) -> tuple[str, str, Callable[[], object]] | None:
        """Why a client's message is refused (``(reason, what, answer)``: ``answer()``
        sends the refusal, once it is counted and logged), or
        None: a REQUEST whose dedup id is not its sender's or, from a key that is not an
        operator's, with drop or checkpoint operations (zps.ops.security.request_refusal);
        from such a key, a STATUS request's commands and a TASK request that changes a job
        (``TaskRequest.operator_only``).  The status report stays open."""
        if len(frames) < 3:
            return None
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except ProtocolError:
            return None
        if route.mtype is MsgType.REQUEST:
            refused = request_refusal(transport.frame_buffer(frames[2]), ident, operator)
            if refused is None:
                return None
            reason, what = refused
            return reason, what, partial(self._refuse, ident, route, Status.BAD_REQUEST, what)
        if route.mtype not in (MsgType.STATUS, MsgType.TASK) or operator:
            return None
        try:
            header = decode([transport.frame_buffer(f) for f in frames[1:]]).header
            task = TaskRequest.parse(header) if route.mtype is MsgType.TASK else None
        except ProtocolError:
            return None  # answered BAD_REQUEST, or dropped as malformed, by the usual path
        if task is not None:
            if not task.operator_only:
                return None
            what = f"{'a restart' if task.op == 'create' else task.op} of job {task.job!r}"
            msg = refused_by_role(what)
            return "wrong_role", msg, partial(self._refuse_call, ident, route, msg)
        asked = [f for f in ADMIN_FIELDS if header.get(f) is not None and header[f] is not False]
        if not asked:
            return None
        msg = refused_by_role(", ".join(asked))
        report = StatusRequest.refusal(msg, refused="role")
        answer = [ident, *encode(Route(MsgType.STATUS, req_id=route.req_id), report)]
        return "wrong_role", msg, partial(self._post, answer)

    def handshake_refused(self, peer: str, key: bytes | None, reason: str) -> None:
        """A handshake the ZAP handler or the socket refused: counted, logged (the
        broker's own key refused: its pair peer's or a routing broker's, not allowed)."""
        self.stats.unauthorized += 1
        own = key is not None and key == self.own_key
        detail = OWN_KEY_REFUSED if own and reason == "key_not_allowed" else ""
        self.refusals.refused(f"a peer {peer}", key, reason, time.monotonic(), detail)

    def wrong_version(self, ident: bytes, node: str, error: VersionMismatchError) -> None:
        """Answer VERSION_MISMATCH (in this protocol version); warn once per peer."""
        self.stats.version_mismatch += 1
        if node not in self._mismatched:
            if len(self._mismatched) >= 4096:
                self._mismatched.clear()
            self._mismatched.add(node)
            log.warning(
                "%s %s speaks protocol version %d, this broker %d (zps %s): answered "
                "VERSION_MISMATCH; see the compatibility rule in docs/design.md",
                "shard" if ident.startswith(b"s-") or is_liveness(ident) else "client",
                node,
                error.version,
                PROTOCOL_VERSION,
                __version__,
            )
        reply = StatusReply(
            Status.VERSION_MISMATCH,
            f"this broker (zps {__version__}) speaks protocol version {PROTOCOL_VERSION}, "
            f"the message was in version {error.version}",
        )
        route = Route(MsgType.REPLY, error.partition, error.epoch, error.req_id)
        prefix = [ident, b""] if ident.startswith(b"s-") or is_liveness(ident) else [ident]
        self._post([*prefix, *encode(route, reply.to_wire())])

    def on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        self.stats.malformed += 1
        node = transport.frame_bytes(frames[0]).decode("utf-8", "replace") if frames else "?"
        log.debug("dropped a malformed message from %s: %s", node, err)
