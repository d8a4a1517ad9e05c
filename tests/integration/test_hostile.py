"""Hostile input: 100,000 random and mutated messages to the broker, to the shards
(through the broker) and to the shards' replication endpoints.  Afterwards every
process is alive, the cluster is healthy, acknowledged data is exact, new writes
work and memory grew by a bounded amount.

The messages come from a seeded RNG, so a run is reproducible: the categories
are listed in :class:`Hostile`.  The broker's ``malformed`` counter is predicted
exactly by the broker's own acceptance rules (:func:`zps.broker.acceptance.accept`,
which the broker calls; see :func:`broker_rejects`), and the replicas' counters from
the replication endpoint's rules (:func:`repl_rejects`).

Separate tests below cover what is not garbage but a protocol-valid message
from a peer that should not be trusted (a fake shard claiming a partition, a
fake replica subscribing); those that show a bug are marked ``xfail(strict)``
with the reason.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zstandard

import zps
from tests.integration.wire import dealer, raw_dealer
from zps.broker.acceptance import Reject, accept
from zps.core.routing import chunk_partition, partitions_of_ids
from zps.errors import ProtocolError
from zps.optim import SGD
from zps.protocol.codec import (
    NO_PARTITION,
    ROUTE,
    CompressPolicy,
    Encoder,
    MsgType,
    Route,
    decode,
    encode,
    unpack_route,
)
from zps.testing import LocalCluster

N_MESSAGES = 100_000
SEED = 20_250_611
RSS_BOUND_MB = 50.0
FLOOD_DEADLINE_S = 90.0
SEND_HWM = 1000
#: The flood waits at a barrier after this many messages, so the broker's backlog
#: (what zmq buffers before it is read) stays bounded and RSS growth measures
#: leaks, not backlog; an unpaced flood is test_an_unpaced_flood_...
WINDOW = 5000
MARKER = 0xB0BB1E5 << 32  # request ids of the barrier requests
#: Send times of the fake shards' barrier heartbeats (the broker echoes them back).
BARRIER_T = -4_242_424.5

DENSE = "hostile-dense"
EMB = "hostile-emb"
LIVE = "hostile-live"  # pushed to by a client during the flood
SCRATCH_DENSE = "zz-scratch-d"  # targets of the mutated valid requests
SCRATCH_EMB = "zz-scratch-e"
EMB_DIM = 8

REPL_TYPES = frozenset({MsgType.SUBSCRIBE, MsgType.ACK})


# -- helpers -------------------------------------------------------------------


def rss_mb(pid: int, field_name: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field_name} for pid {pid}")


#: The message types this test knows the rules for (1..13) on the replication
#: endpoint, and draws random routes from; types added later (e.g. for training) may be
#: accepted there: their messages are counted as "uncertain" instead of predicted.
KNOWN_TYPES = frozenset(MsgType(v) for v in range(1, 14))


@dataclass
class Members:
    """A membership for :func:`accept`; whether a message is malformed never depends on
    it (only whether a reply is forwarded, stale or a commit answer does)."""

    shards: frozenset[str] = frozenset()

    def primary_of(self, partition: int) -> str | None:
        return None


def broker_rejects(frames: list[bytes], *, shard: bool) -> bool:
    """Whether the broker counts this message (without the sender identity) as malformed:
    its own acceptance rules say so."""
    verdict = accept(b"s-fake-0" if shard else b"c-hostile-0", frames, Members())
    return isinstance(verdict, Reject) and verdict.counter == "malformed"


def repl_rejects(frames: list[bytes]) -> bool | None:
    """Whether a shard's replication endpoint counts this message as malformed."""
    try:
        msg = decode(frames)
    except ProtocolError:
        return True
    if msg.route.mtype not in KNOWN_TYPES:
        return None
    return msg.route.mtype not in REPL_TYPES


def zstd_frame_claiming(size: int, body: bytes) -> bytes:
    """A zstd frame header declaring ``size`` content bytes, followed by ``body``."""
    # magic, frame header descriptor: 8-byte content size, single segment
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, size) + body


@dataclass
class Template:
    """A valid request recorded from real traffic: its frames, and where it goes."""

    frames: list[bytes]
    what: str


@dataclass
class Msg:
    dest: str  # "client", "fake" (a fake shard's DEALER) or "repl<k>"
    category: str
    frames: list[bytes]


class Hostile:
    """Deterministic generator of hostile messages (see the category methods)."""

    WEIGHTS: dict[str, int] = {
        "random_bytes": 12,
        "frame_count": 10,
        "bad_route_or_header": 10,
        "wrong_types": 10,
        "bad_request": 20,
        "mutated_valid": 18,
        "fake_shard": 8,
        "client_control": 4,
        "repl_garbage": 8,
    }

    def __init__(
        self,
        seed: int,
        *,
        epochs: dict[int, int],
        templates: list[Template],
        n_repl: int,
    ) -> None:
        self.rng = random.Random(seed)
        self.epochs = epochs
        self.templates = templates
        self.n_repl = n_repl
        self.seq = 0
        self._zero_frame = zstandard.ZstdCompressor().compress(bytes(4096))

    # -- values ------------------------------------------------------------

    def value(self, depth: int = 0) -> Any:
        """A random msgpack value: the wrong type for almost any field."""
        r = self.rng
        kind = r.randrange(14 if depth < 3 else 10)
        match kind:
            case 0:
                return r.randint(-5, 5)
            case 1:
                return r.choice([2**63 - 1, -(2**63), 2**64 - 1, 2**32, -(2**31) - 1])
            case 2:
                return r.choice([0.5, -1e308, float("inf"), float("nan"), 1e-300])
            case 3:
                return "".join(chr(r.randrange(32, 0x2FFF)) for _ in range(r.randrange(12)))
            case 4:
                return r.randbytes(r.randrange(24))
            case 5:
                return None
            case 6:
                return r.random() < 0.5
            case 7:
                return r.choice(["op", "ops", "t", "ids", "g", "push_rows", "spare", DENSE])
            case 8:
                return "x" * r.choice([100, 1000, 20_000])
            case 9:
                return r.choice([[], {}, "", b""])
            case 10 | 11:
                return [self.value(depth + 1) for _ in range(r.randrange(6))]
            case _:
                return {
                    str(self.value(depth + 1))[:16]: self.value(depth + 1)
                    for _ in range(r.randrange(6))
                }

    def packed(self, obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    def garbage(self) -> bytes:
        r = self.rng
        n = r.choice([0, 1, 2, 19, 20, 21, r.randrange(64), r.randrange(64), r.randrange(4096)])
        head = r.choice([b"", b"", b"ZP", b"ZP\x01", b"\x82", b"\xdf\xff\xff\xff\xff"])
        return head + r.randbytes(n)

    def route(self, mtype: int | None = None) -> bytes:
        r = self.rng
        if mtype is None:
            mtype = r.choice(sorted(KNOWN_TYPES))
        partition = r.choice([0, 1, 0, 1, NO_PARTITION, 2, 2**31 - 1, -(2**31)])
        epoch = self.epochs.get(partition, 0) if r.random() < 0.8 else r.randrange(2**32)
        return Route(MsgType(mtype), partition, epoch, r.randrange(2**64)).pack()

    def request_route(self) -> bytes:
        r = self.rng
        if r.random() < 0.85:
            p = r.randrange(2)
            epoch = self.epochs[p] if r.random() < 0.9 else self.epochs[p] + r.randint(1, 9)
        else:
            p = r.choice([-1, 2, 3, 2**31 - 1, -(2**31)])
            epoch = r.randrange(2**32)
        return Route(MsgType.REQUEST, p, epoch, r.randrange(2**64)).pack()

    def bad_desc(self, n_payloads: int) -> tuple[Any, list[bytes]]:
        """An array descriptor that ``array_from`` must reject, and extra payloads."""
        r = self.rng
        idx = r.randrange(max(1, n_payloads + 1))
        match r.randrange(12):
            case 0:
                return self.value(), []  # not a 4-list (or by chance a wrong one)
            case 1:  # huge declared shapes
                shape = r.choice([[2**39, 2**39], [2**40 - 1, 2**40 - 1], [2**39] * 8, [2**30] * 3])
                return [0, "float64", shape, r.choice([0, 1])], [b""]
            case 2:  # invalid shapes
                shape = r.choice([[-1], [1.5], ["3"], [True], [1] * 9, [[2]], 7, None, [2**40]])
                return [0, "int64", shape, 0], [b"\0" * 8]
            case 3:  # wrong dtypes
                dtype = r.choice(["float128", "object", "<f8", "", "int8", "bool", 5, None, "U4"])
                return [0, dtype, [1], 0], [b"\0" * 8]
            case 4:  # frame index out of range / wrong type
                index = r.choice([-1, n_payloads + 3, 99, 2**63 - 1, "0", 0.0, None, True])
                return [index, "int64", [1], 0], []
            case 5:  # zstd codec on garbage
                return [0, "int64", [512], 1], [self.garbage()]
            case 6:  # zstd frame claiming a huge content size
                claim = r.choice([2**40, 2**62, 2**29, 4097])
                return [0, "int64", [512], 1], [zstd_frame_claiming(claim, self.garbage())]
            case 7:  # zstd frame claiming exactly the (large, allowed) declared size, garbage body
                return [0, "float64", [2**26], 1], [zstd_frame_claiming(2**29, self.garbage())]
            case 8:  # a valid zstd frame whose size does not match the shape
                return [0, "float64", [r.choice([1, 511, 513])], 1], [self._zero_frame]
            case 9:  # raw frame of the wrong length
                n = r.randrange(1, 64)
                return [0, "float64", [n], 0], [bytes(8 * n + r.choice([-1, 1, 8]))]
            case 10:  # unknown codecs
                return [0, "int64", [1], r.choice([2, -1, 255, "zstd", None, 1.0])], [bytes(8)]
            case _:
                return [idx, "float64", [1, EMB_DIM], 0], []  # refers past the payloads

    # -- categories -----------------------------------------------------------

    def random_bytes(self) -> Msg:
        """1-4 frames of random bytes."""
        return Msg(
            "client", "random_bytes", [self.garbage() for _ in range(self.rng.randint(1, 4))]
        )

    def frame_count(self) -> Msg:
        """0..12 frames of plausible pieces (0 frames cannot be sent: one empty frame)."""
        r = self.rng
        n = r.randint(0, 12)
        pieces: list[Callable[[], bytes]] = [
            self.route,
            self.request_route,
            lambda: b"",
            self.garbage,
            lambda: self.packed({}),
            lambda: self.packed({"ops": [{"op": "checksum"}]}),
        ]
        frames = [r.choice(pieces)() for _ in range(n)]
        return Msg("client", "frame_count", frames or [b""])

    def bad_route_or_header(self) -> Msg:
        """Broken route frames, or a valid route followed by a header that is not msgpack."""
        r = self.rng
        route = self.route()
        if r.random() < 0.4:
            good = route
            route = r.choice(
                [
                    b"XX" + good[2:],
                    good[:2] + bytes([r.choice([0, 2, 255])]) + good[3:],
                    good[:3] + bytes([r.choice([0, 14, 99, 255])]) + good[4:],
                    good[: r.randrange(20)],
                    good + r.randbytes(r.randint(1, 4)),
                ]
            )
        valid = self.packed({"ops": [{"op": "checksum"}], "host": "h"})
        header = r.choice(
            [
                self.garbage(),
                b"\xc1",
                valid[: r.randrange(1, len(valid))],
                valid + b"\x00",
                b"\xdf\xff\xff\xff\xff",  # a map claiming 4 billion entries
                b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion entries
                b"\xc6\xff\xff\xff\xf0",  # bin claiming 4 GB
            ]
        )
        if r.random() < 0.001:
            header = b"\x80" + bytes((1 << 20) + 1)  # over the 1 MiB header limit
        extra = [self.garbage() for _ in range(r.choice([0, 0, 0, 1, 3]))]
        return Msg("client", "bad_route_or_header", [route, header, *extra])

    def wrong_types(self) -> Msg:
        """A valid route of a client type, and msgpack of the wrong types."""
        r = self.rng
        mtype = r.choice(
            [MsgType.HELLO, MsgType.HEARTBEAT, MsgType.BYE, MsgType.REQUEST, MsgType.HELLO]
        )
        if r.random() < 0.02:
            mtype = MsgType.STATUS  # its reply is large: only now and then
        route = self.request_route() if mtype is MsgType.REQUEST else Route(mtype).pack()
        match r.randrange(4):
            case 0:  # not a map at all
                header = self.packed(self.value())
            case 1:  # a map with integer keys (refused by strict_map_key)
                header = self.packed({r.randrange(9): self.value()})
            case 2:  # the right keys, wrong values
                header = self.packed(
                    {
                        "host": self.value(),
                        "pid": self.value(),
                        "name": self.value(),
                        "ops": self.value(),
                        "cid": self.value(),
                        "seq": self.value(),
                    }
                )
            case _:
                header = self.packed(self.value())
        return Msg("client", "wrong_types", [route, header])

    def bad_request(self) -> Msg:
        """REQUESTs with unknown ops, wrong field types and bad array descriptors.

        Pushes that name the checked tables always carry a descriptor the codec
        refuses, so they must not change them.
        """
        r = self.rng
        payloads = [self.garbage() for _ in range(r.randrange(3))]
        ops: list[Any] = []
        for _ in range(r.choice([1, 1, 2, 3, 5])):
            kind = r.randrange(10)
            table = r.choice([DENSE, EMB, SCRATCH_EMB, "nope", self.value()])
            match kind:
                case 0:  # unknown ops
                    ops.append({"op": r.choice(["explode", "", "PUSH_ROWS", "__init__"])})
                case 1:
                    ops.append({"op": self.value(), "t": table})
                case 2:  # known ops, wrong field types
                    ops.append(
                        {
                            "op": r.choice(["pull_dense", "push_dense", "pull_rows", "tables"]),
                            "t": self.value(),
                            "chunks": self.value(),
                            "chunk": self.value(),
                        }
                    )
                case 3:
                    ops.append({"op": "pull_dense", "t": DENSE, "chunks": self.value()})
                case 4 | 5:
                    desc, extra = self.bad_desc(len(payloads))
                    ops.append({"op": "push_rows", "t": table, "ids": desc, "g": desc})
                    payloads += extra
                case 6:
                    ids = [len(payloads), "int64", [2], 0]
                    payloads.append(np.array([1, 2], dtype=np.int64).tobytes())
                    desc, extra = self.bad_desc(len(payloads))
                    ops.append({"op": "push_rows", "t": table, "ids": ids, "g": desc})
                    payloads += extra
                case 7:
                    desc, extra = self.bad_desc(len(payloads))
                    ops.append({"op": "push_dense", "t": table, "chunk": 0, "g": desc})
                    payloads += extra
                case 8:
                    desc, extra = self.bad_desc(len(payloads))
                    ops.append({"op": "pull_rows", "t": table, "ids": desc})
                    payloads += extra
                case _:  # create with a bad spec
                    spec = {
                        "kind": r.choice(["dense", "embedding", "x", None]),
                        "name": r.choice([DENSE, EMB, "", "y" * 300, self.value()]),
                        "shape": r.choice([[2**39, 2**39], [-1], "3", [2**62]]),
                        "dim": r.choice([0, 2**40, -3, "8"]),
                        "dtype": r.choice(["float64", "int8", None]),
                        "init": self.value(),
                        "optimizer": self.value(),
                        "seed": self.value(),
                    }
                    if r.random() < 0.5:
                        spec.pop(r.choice(list(spec)))
                    ops.append({"op": "create", "spec": spec})
        header: dict[str, Any] = {"ops": ops}
        if r.random() < 0.7:
            self.seq += 1
            header["cid"], header["seq"] = b"c-hostile-bad", self.seq
        elif r.random() < 0.5:
            header["cid"], header["seq"] = self.value(), self.value()
        if r.random() < 0.05:
            header["ops"] = r.choice([[], "ops", None, [{}] * 4097])
        if r.random() < 0.1:
            header["acks"] = self.value()
        return Msg("client", "bad_request", [self.request_route(), self.packed(header), *payloads])

    def mutated_valid(self) -> Msg:
        """A recorded valid request with 1-3 mutations: bit flips, truncation, duplication, ..."""
        r = self.rng
        frames = [bytearray(f) for f in r.choice(self.templates).frames]
        for _ in range(r.randint(1, 3)):
            i = r.randrange(len(frames))
            match r.randrange(7):
                case 0 | 1:  # bit flips
                    if frames[i]:
                        for _ in range(r.randint(1, 8)):
                            pos = r.randrange(len(frames[i]))
                            frames[i][pos] ^= 1 << r.randrange(8)
                case 2:  # truncation
                    frames[i] = frames[i][: r.randrange(len(frames[i]) + 1)]
                case 3:  # duplication of a frame
                    frames.insert(i, bytearray(frames[i]))
                case 4:  # a frame dropped
                    if len(frames) > 1:
                        del frames[i]
                case 5:  # two frames swapped
                    j = r.randrange(len(frames))
                    frames[i], frames[j] = frames[j], frames[i]
                case _:  # a junk frame appended
                    frames.append(bytearray(self.garbage()))
        return Msg("client", "mutated_valid", [bytes(f) for f in frames])

    def fake_shard(self) -> Msg:
        """From DEALERs with shard identities (s-fake-*): REGISTER, HEARTBEAT, BYE, garbage."""
        r = self.rng
        kind = r.randrange(8)
        match kind:
            case 0 | 1:  # REGISTER with plausible or garbage claims
                claim = r.choice(
                    [
                        None,
                        self.value(),
                        {
                            "partition": r.choice([0, 1, 2, -1, "0", 2**40]),
                            "epoch": r.choice([0, 1, 7, 2**40, -1, "1", 2**63]),
                            "role": r.choice(["primary", "replica", "spare", "king", None]),
                            "lsn": r.choice([0, 10**9, -5, 2**64 - 1, "x"]),
                            "in_sync": self.value(),
                        },
                    ]
                )
                h = {
                    "host": self.value(),
                    "pid": self.value(),
                    "address": r.choice(["", "tcp://127.0.0.1:1", self.value()]),
                    "claim": claim,
                    "public_key": r.choice([None, "k" * 40, self.value()]),
                }
                frames = [b"", Route(MsgType.REGISTER).pack(), self.packed(h)]
            case 2 | 3:  # HEARTBEAT with wrong types
                h = {
                    "t": self.value(),
                    "lsn": self.value(),
                    "epoch": self.value(),
                    "stats": self.value(),
                    "in_sync": r.choice([self.value(), ["s-fake-0", "s-whoever"]]),
                }
                frames = [b"", Route(MsgType.HEARTBEAT).pack(), self.packed(h)]
            case 4:
                frames = [b"", Route(MsgType.BYE).pack(), self.packed(self.value())]
            case 5:  # shard types a shard may not send, and broken control frames
                frames = [b"", self.route(), r.choice([self.packed({}), self.garbage()])]
            case 6:  # "replies" to random (unroutable) targets
                frames = [r.choice([b"c-", b"s-", b""]) + r.randbytes(8), self.route(), b"\x80"]
            case _:  # too few frames / garbage
                frames = [self.garbage() for _ in range(r.randint(1, 3))]
        return Msg("fake", "fake_shard", frames)

    def client_control(self) -> Msg:
        """Types a client may not send (MAP, ASSIGN, REPLY, ...), with well-formed headers."""
        r = self.rng
        mtype = r.choice(
            [
                MsgType.MAP,
                MsgType.ASSIGN,
                MsgType.REPLY,
                MsgType.REGISTER,
                MsgType.SUBSCRIBE,
                MsgType.SNAPSHOT,
                MsgType.REPLICATE,
                MsgType.ACK,
            ]
        )
        header = r.choice(
            [
                {"role": "spare", "partition": None, "epoch": 0},
                {"role": "primary", "partition": 0, "epoch": 2**40},
                {"map": self.value()},
                {"st": "OK", "res": []},
                {},
            ]
        )
        route = Route(mtype, r.choice([0, 1, NO_PARTITION]), self.epochs[0], r.randrange(99))
        return Msg("client", "client_control", [route.pack(), self.packed(header)])

    def repl_garbage(self) -> Msg:
        """Straight to a shard's replication ROUTER: bad SUBSCRIBE / ACK / other frames.

        A SUBSCRIBE never names a (partition, epoch) a primary serves: that would be
        a protocol-valid subscription (see the separate test below).
        """
        r = self.rng
        dest = f"repl{r.randrange(self.n_repl)}"
        match r.randrange(6):
            case 0 | 1:
                h = {
                    "partition": r.choice([0, 1, 99, -1, "0", None, [0], 2**40, 0.5]),
                    "epoch": r.choice([10**6, -1, "1", None, [1], 0.5, 2**63, self.value()]),
                }
                if r.random() < 0.3:
                    h = self.value()
                frames = [Route(MsgType.SUBSCRIBE).pack(), self.packed(h)]
            case 2 | 3:
                h = {"lsn": self.value(), "epoch": self.value()}
                frames = [Route(MsgType.ACK).pack(), self.packed(h)]
            case 4:
                frames = [self.route(), self.packed(self.value()), *[self.garbage()] * 2]
            case _:
                frames = [self.garbage() for _ in range(self.rng.randint(1, 5))]
        return Msg(dest, "repl_garbage", frames)

    def generate(self, n: int) -> list[Msg]:
        names = list(self.WEIGHTS)
        weights = list(self.WEIGHTS.values())
        makers = {name: getattr(self, name) for name in names}
        return [makers[name]() for name in self.rng.choices(names, weights, k=n)]


# -- the flood -----------------------------------------------------------------


@dataclass
class FloodResult:
    sent: int = 0
    sent_by: collections.Counter[str] = field(default_factory=collections.Counter)
    replies: collections.Counter[str] = field(default_factory=collections.Counter)
    send_s: float = 0.0
    waits: int = 0
    barriers: int = 0


class Flood:
    """Non-blocking sends from a few DEALERs; replies are drained as they come."""

    def __init__(self, broker: str, repl_addresses: list[str]) -> None:
        self.ctx = zmq.Context()
        self.socks: dict[str, list[zmq.Socket]] = {"client": [], "fake": []}
        self.all: list[zmq.Socket] = []
        for i in range(4):
            self.socks["client"].append(self._dealer(broker, f"c-hostile-{i}".encode()))
        for i in range(2):
            self.socks["fake"].append(self._dealer(broker, f"s-fake-{i}".encode()))
        for k, addr in enumerate(repl_addresses):
            self.socks[f"repl{k}"] = [self._dealer(addr, f"r-hostile-{k}".encode())]
        self.poller = zmq.Poller()
        for s in self.all:
            self.poller.register(s, zmq.POLLIN)
        self.result = FloodResult()
        self.markers: dict[str, int] = {}

    def _dealer(self, address: str, identity: bytes) -> zmq.Socket:
        s = dealer(self.ctx, address, identity, SNDHWM=SEND_HWM, RCVHWM=100_000)
        self.all.append(s)
        return s

    def close(self) -> None:
        for s in self.all:
            s.close(0)
        self.ctx.term()

    def _count(self, frames: list[bytes]) -> None:
        for i, f in enumerate(frames[:2]):
            if len(f) == ROUTE.size and f[:2] == b"ZP":
                try:
                    route = unpack_route(f)
                except ProtocolError:
                    break
                key = route.mtype.name
                self._marker(route, frames[i + 1 : i + 2])
                if route.mtype is MsgType.REPLY and i + 1 < len(frames):
                    try:
                        key += ":" + str(msgpack.unpackb(frames[i + 1]).get("st"))
                    except Exception:
                        key += ":?"
                self.result.replies[key] += 1
                return
        self.result.replies["other"] += 1

    def _marker(self, route: Route, header: list[bytes]) -> None:
        if route.mtype is MsgType.REPLY and MARKER <= route.req_id < MARKER + 16:
            self.markers[f"req-{route.req_id - MARKER}-{route.partition}"] = 1
            return
        if route.mtype in (MsgType.HEARTBEAT, MsgType.BYE) and header:
            try:
                h = msgpack.unpackb(header[0])
            except Exception:
                return
            if not isinstance(h, dict):
                return
            t = h.get("t")
            if isinstance(t, float) and BARRIER_T - 16 < t <= BARRIER_T:
                self.markers[f"marker-{int(BARRIER_T - t)}"] = 1
                return
            text = str(h.get("msg", ""))
            if "marker-" in text:
                self.markers[text[text.index("marker-") :]] = 1

    def drain(self) -> int:
        n = 0
        for s in self.all:
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._count(frames)
                n += 1
        return n

    def barrier(self, epochs: dict[int, int], timeout: float = 30.0) -> float:
        """Wait until every process has handled everything sent so far.

        Each peer's messages are handled in order, so one last message per socket
        whose answer is recognisable marks the end: a REQUEST with a marker id to
        each partition (answered by the primary after the broker routed all before
        it), a HEARTBEAT from a fake shard right after a REGISTER (the echo carries
        its send time, the marker) and a SUBSCRIBE to a replication endpoint (refused with a BYE
        naming the marker).
        """
        t0 = time.monotonic()
        self.markers.clear()
        names: set[str] = set()  # the markers expected back
        for i, s in enumerate(self.socks["client"]):
            for p, epoch in epochs.items():
                route = Route(MsgType.REQUEST, p, epoch, MARKER + i)
                s.send_multipart(encode(route, {"ops": [{"op": "checksum"}]}))
                names.add(f"req-{i}-{p}")
        for i, s in enumerate(self.socks["fake"]):
            s.send_multipart([b"", *encode(Route(MsgType.REGISTER), {"host": "barrier"})])
            s.send_multipart([b"", *encode(Route(MsgType.HEARTBEAT), {"t": BARRIER_T - i})])
            names.add(f"marker-{i}")
        for name, socks in self.socks.items():
            if name.startswith("repl"):
                head = {"partition": -1, "epoch": f"marker-{name}"}
                socks[0].send_multipart(encode(Route(MsgType.SUBSCRIBE), head))
                names.add(f"marker-{name}")
        expected = len(names)
        deadline = t0 + timeout
        while self.markers_seen() < expected:
            assert time.monotonic() < deadline, (
                f"only {self.markers_seen()} of {expected} barrier answers in {timeout}s; "
                f"missing {sorted(names - self.markers.keys())}"
            )
            if self.poller.poll(100):
                self.drain()
        return time.monotonic() - t0

    def markers_seen(self) -> int:
        return sum(self.markers.values())

    def send_all(
        self, msgs: list[Msg], epochs: dict[int, int] | None = None, window: int = 0
    ) -> FloodResult:
        """Send every message; with ``window``, wait at a barrier after each ``window``."""
        t0 = time.monotonic()
        deadline = t0 + FLOOD_DEADLINE_S
        rr: collections.Counter[str] = collections.Counter()
        for i, m in enumerate(msgs):
            pool = self.socks[m.dest]
            sock = pool[rr[m.dest] % len(pool)]
            rr[m.dest] += 1
            while True:
                try:
                    sock.send_multipart(m.frames, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    self.result.waits += 1
                    self.drain()
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"sent only {i} of {len(msgs)} messages in {FLOOD_DEADLINE_S}s"
                        ) from None
                    zmq.select([], [sock], [], 0.05)
            self.result.sent += 1
            self.result.sent_by[m.category] += 1
            if i % 128 == 0:
                self.drain()
            if window and epochs is not None and (i + 1) % window == 0:
                self.result.barriers += 1
                self.barrier(epochs)
        self.result.send_s = time.monotonic() - t0
        return self.result


# -- the test --------------------------------------------------------------------


def recorded_templates(cmap: Any, epochs: dict[int, int]) -> list[Template]:
    """Valid requests on the scratch tables, as a client builds them."""
    out: list[Template] = []
    zstd = CompressPolicy(min_bytes=256, sample_bytes=256)
    d_part = chunk_partition(SCRATCH_DENSE, 0, cmap)
    candidates = np.arange(1000, 5000, dtype=np.int64)
    owner = partitions_of_ids(candidates, cmap)
    seq = 0

    def build(p: int, ops: list[tuple[dict[str, Any], dict[str, np.ndarray]]], what: str) -> None:
        nonlocal seq
        for policy in (CompressPolicy(), zstd):
            seq += 1
            enc = Encoder(policy)
            bodies = []
            for body, arrays in ops:
                body = dict(body)
                for k, a in arrays.items():
                    body[k] = enc.array(a)
                bodies.append(body)
            header = {"cid": f"c-scratch-{p}".encode(), "seq": seq, "ops": bodies}
            frames = enc.build(Route(MsgType.REQUEST, p, epochs[p], seq), header)
            out.append(Template([bytes(f) for f in frames], what))

    g16 = np.arange(16, dtype=np.float64)
    build(d_part, [({"op": "push_dense", "t": SCRATCH_DENSE, "chunk": 0}, {"g": g16})], "push_d")
    build(d_part, [({"op": "pull_dense", "t": SCRATCH_DENSE, "chunks": [0]}, {})], "pull_d")
    for p in (0, 1):
        ids = candidates[owner == p][:64]
        dup = np.repeat(ids[:2], 64)  # duplicates: compressible ids
        g = np.ones((ids.size, 4))
        build(p, [({"op": "push_rows", "t": SCRATCH_EMB}, {"ids": ids, "g": g})], "push_e")
        build(
            p,
            [({"op": "push_rows", "t": SCRATCH_EMB}, {"ids": dup, "g": np.ones((128, 4))})],
            "dup",
        )
        build(p, [({"op": "pull_rows", "t": SCRATCH_EMB}, {"ids": ids})], "pull_e")
        build(
            p,
            [
                ({"op": "pull_rows", "t": SCRATCH_EMB}, {"ids": ids[:8]}),
                ({"op": "push_rows", "t": SCRATCH_EMB}, {"ids": ids[:8], "g": g[:8]}),
                ({"op": "checksum"}, {}),
                ({"op": "tables"}, {}),
            ],
            "batch",
        )
    return out


async def replay(address: str, templates: list[Template], timeout: float = 10.0) -> None:
    """Send the templates unmodified once: each must be answered OK (so they are valid)."""
    with raw_dealer(address, b"c-hostile-recorder") as s:
        for t in templates:
            s.send_multipart(t.frames)
            assert await asyncio.to_thread(s.poll, int(timeout * 1000)), f"{t.what}: no reply"
            reply = s.recv_multipart()
            body = msgpack.unpackb(reply[1])
            assert body["st"] == "OK" and all(r["st"] == "OK" for r in body["res"]), (t.what, body)


def procs_memory(cluster: LocalCluster) -> dict[str, tuple[float, float]]:
    return {p.name: (rss_mb(p.pid), rss_mb(p.pid, "VmHWM")) for p in cluster.procs}


@pytest.mark.timeout(180)
async def test_hostile_messages_leave_every_process_serving_exact_results() -> None:
    t_start = time.monotonic()
    with LocalCluster(partitions=2, shards=4, replication=2, log_level="error") as c:
        status = await asyncio.to_thread(c.status)
        epochs = {p["partition"]: p["epoch"] for p in status["partitions"]}
        shard_addrs = [s["address"] for s in status["shards"]]
        roles = {s["address"]: (s["role"], s["partition"]) for s in status["shards"]}

        # -- before: known values --------------------------------------------
        rng = np.random.default_rng(1)
        ids = np.arange(0, 400, dtype=np.int64)
        async with zps.connect(c.address, timeout=30) as ps:
            await ps.create_dense(DENSE, shape=(40_000,), dtype="float64", optimizer=SGD(lr=1.0))
            await ps.create_embedding(EMB, dim=EMB_DIM, dtype="float64", optimizer=SGD(lr=1.0))
            await ps.create_embedding(LIVE, dim=4, dtype="float64", optimizer=SGD(lr=1.0))
            await ps.create_dense(SCRATCH_DENSE, shape=(16,), dtype="float64")
            await ps.create_embedding(SCRATCH_EMB, dim=4, dtype="float64")
            g_dense = rng.integers(-50, 50, size=40_000).astype(np.float64)
            g_rows = rng.integers(-50, 50, size=(ids.size, EMB_DIM)).astype(np.float64)
            await ps.push_dense(DENSE, g_dense)
            await ps.push_dense(DENSE, g_dense)
            await ps.push_rows(EMB, ids, g_rows)
            await ps.push_rows(EMB, ids[:100], g_rows[:100])
            expect_dense = -2 * g_dense
            expect_rows = -g_rows.copy()
            expect_rows[:100] *= 2
            assert np.array_equal(await ps.pull_dense(DENSE), expect_dense)
            assert np.array_equal(await ps.pull_rows(EMB, ids), expect_rows)
            cmap = ps.cluster_map
            assert len(set(partitions_of_ids(ids, cmap).tolist())) == 2
        templates = recorded_templates(cmap, epochs)
        await replay(c.address, templates)

        gen = Hostile(SEED, epochs=epochs, templates=templates, n_repl=len(shard_addrs))
        t0 = time.monotonic()
        msgs = gen.generate(N_MESSAGES)
        gen_s = time.monotonic() - t0
        assert len(msgs) == N_MESSAGES
        verdicts = collections.Counter(
            broker_rejects(m.frames, shard=m.dest == "fake")
            for m in msgs
            if m.dest in ("client", "fake")
        )
        repl_verdicts = collections.Counter((m.dest, repl_rejects(m.frames)) for m in msgs)

        before = await asyncio.to_thread(c.status)
        mem_before = procs_memory(c)
        shard_malformed_before = {s["address"]: s["stats"]["malformed"] for s in before["shards"]}

        # -- the flood, while a client keeps pushing to LIVE -------------------
        live_ids = np.arange(10_000, 10_064, dtype=np.int64)
        live = {"acked": 0.0, "pushes": 0, "errors": []}
        flood_done = asyncio.Event()

        async def witness() -> None:
            async with zps.connect(c.address, timeout=30, name="witness") as ps:
                while not flood_done.is_set():
                    v = float(live["pushes"] % 5 + 1)
                    try:
                        await ps.push_rows(LIVE, live_ids, np.full((live_ids.size, 4), v))
                    except Exception as e:  # any error fails the test below
                        live["errors"].append(repr(e))
                        return
                    live["acked"] += v
                    live["pushes"] += 1

        flood = Flood(c.address, shard_addrs)
        try:
            # Every DEALER to the broker connected (a reply came) before the flood.
            for s in flood.socks["client"]:
                s.send_multipart(encode(Route(MsgType.STATUS), {}))
            for s in flood.socks["client"]:
                assert s.poll(5000), "the broker does not answer"
                s.recv_multipart()
            task = asyncio.create_task(witness())
            try:
                result = await asyncio.to_thread(flood.send_all, msgs, epochs, WINDOW)
                barrier_s = await asyncio.to_thread(flood.barrier, epochs)
            finally:
                flood_done.set()
                await asyncio.wait_for(task, 60)
        finally:
            flood.close()
        flood_s = time.monotonic() - t0 - gen_s

        # -- after ------------------------------------------------------------
        dead = [(p.name, p.popen.returncode, p.log()[-2000:]) for p in c.procs if not p.alive()]
        assert not dead, dead
        # The fake shards (silent now) leave the map; the real four are all in it.
        after = await asyncio.to_thread(
            c.wait_for,
            lambda s: c.healthy(s) and {x["address"] for x in s["shards"]} == set(shard_addrs),
            20,
            "a healthy cluster without the fake shards",
        )
        assert {p["partition"]: p["epoch"] for p in after["partitions"]} == epochs, (
            "a failover happened during the flood"
        )
        assert after["failovers"] == before["failovers"]
        for s in after["shards"]:
            assert roles[s["address"]] == (s["role"], s["partition"]), s
        assert not live["errors"], live["errors"]
        async with zps.connect(c.address, timeout=30) as ps:
            assert np.array_equal(await ps.pull_dense(DENSE), expect_dense)
            assert np.array_equal(await ps.pull_rows(EMB, ids), expect_rows)
            got_live = await ps.pull_rows(LIVE, live_ids)
            assert np.array_equal(got_live, np.full_like(got_live, -live["acked"])), (
                live,
                np.unique(got_live),
            )
            # new writes work and are exact
            await ps.push_dense(DENSE, np.ones(40_000))
            await ps.push_rows(EMB, ids, np.ones((ids.size, EMB_DIM)))
            assert np.array_equal(await ps.pull_dense(DENSE), expect_dense - 1)
            assert np.array_equal(await ps.pull_rows(EMB, ids), expect_rows - 1)
            sums = await ps.checksums()

        # replicas hold what their primaries hold
        def caught_up(st: dict[str, Any]) -> bool:
            at = {(s["partition"], s["role"]): s["lsn"] for s in st["shards"]}
            return c.healthy(st) and all(
                at.get((p, "replica")) == at.get((p, "primary")) == sums[p]["lsn"] for p in (0, 1)
            )

        final = await asyncio.to_thread(c.wait_for, caught_up, 10, "the replicas to catch up")
        lsns = {(s["partition"], s["role"]): s["lsn"] for s in final["shards"]}
        for p in (0, 1):
            assert lsns[(p, "replica")] == lsns[(p, "primary")] == sums[p]["lsn"], final

        malformed = after["broker"]["malformed"] - before["broker"]["malformed"]
        assert malformed == verdicts[True], (malformed, verdicts)
        shard_malformed = {
            s["address"]: s["stats"]["malformed"] - shard_malformed_before[s["address"]]
            for s in after["shards"]
        }
        for k, addr in enumerate(shard_addrs):
            sure, unsure = repl_verdicts[(f"repl{k}", True)], repl_verdicts[(f"repl{k}", None)]
            if roles[addr][0] == "replica":  # it gets nothing else
                assert sure <= shard_malformed[addr] <= sure + unsure, (addr, shard_malformed)
            else:  # and the bad requests the broker routed to it
                assert shard_malformed[addr] > sure, (addr, shard_malformed, sure)

        await asyncio.sleep(0.5)
        mem_after = procs_memory(c)
        growth = {n: mem_after[n][0] - mem_before[n][0] for n in mem_after}
        report = {
            "messages": result.sent,
            "by_category": dict(sorted(result.sent_by.items())),
            "generate_s": round(gen_s, 2),
            "send_s": round(result.send_s, 2),
            "send_rate_per_s": round(result.sent / result.send_s),
            "barrier_s": round(barrier_s, 2),
            "flood_incl_barrier_s": round(flood_s, 2),
            "hwm_waits": result.waits,
            "barriers": result.barriers,
            "replies": dict(sorted(result.replies.items())),
            "broker_malformed": malformed,
            "broker_malformed_predicted": {str(k): v for k, v in verdicts.items()},
            "repl_malformed_predicted": {
                f"{d}:{v}": n
                for (d, v), n in sorted(repl_verdicts.items(), key=str)
                if d != "client"
            },
            "broker_counters_after": after["broker"],
            "shard_malformed": {
                f"{roles[a][0]}{roles[a][1]}": v for a, v in shard_malformed.items()
            },
            "witness_pushes": live["pushes"],
            "rss_mb_before_after_peak": {
                n: (
                    round(mem_before[n][0], 1),
                    round(mem_after[n][0], 1),
                    round(mem_after[n][1], 1),
                )
                for n in mem_after
            },
            "test_s": round(time.monotonic() - t_start, 1),
        }
        print("\nHOSTILE REPORT " + json.dumps(report, indent=1))
        for name, mb in growth.items():
            assert mb < RSS_BOUND_MB, (name, growth)


# -- protocol-valid messages from peers that should not be trusted ----------------


def recv_until(sock: zmq.Socket, want: Callable[[Route, dict[str, Any]], bool], timeout: float):
    """The first message (``[.., route, header, ..]``) that ``want`` accepts, or None."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            return None
        frames = sock.recv_multipart()
        for i, f in enumerate(frames[:2]):
            if len(f) == ROUTE.size and f[:2] == b"ZP" and i + 1 < len(frames):
                route, header = unpack_route(f), msgpack.unpackb(frames[i + 1])
                if want(route, header):
                    return route, header
    return None


async def seeded(c: LocalCluster) -> tuple[np.ndarray, np.ndarray]:
    """An embedding table on both partitions with known values (ids, values)."""
    ids = np.arange(64, dtype=np.int64)
    async with zps.connect(c.address, timeout=10) as ps:
        await ps.create_embedding(EMB, dim=4, dtype="float64", optimizer=SGD(lr=1.0))
        await ps.push_rows(EMB, ids, np.ones((64, 4)))
        return ids, await ps.pull_rows(EMB, ids)


@pytest.mark.timeout(60)
async def test_a_fake_shard_claiming_a_partition_at_a_huge_epoch_gets_nothing() -> None:
    """Outside the broker's start-up hold a claim never displaces a live primary that
    took writes: a primary claim of a newer history is a conflict (the claimant is held
    with no role, nothing overwritten, zps/core/cluster.py rule 8); replica claims of
    another epoch make the claimant a spare.

    (Within the hold, after a broker restart, a claim of primary at a higher epoch
    than the one granted first wins by design (``ClusterState._grant``): a fake
    shard registering then would take the partition over and serve it empty.
    That is the trust model without CURVE, not a parsing bug; not tested here.)
    """
    with LocalCluster(partitions=2, shards=4, replication=2, log_level="error") as c:
        ids, values = await seeded(c)
        before = await asyncio.to_thread(c.status)
        ctx = zmq.Context()
        try:
            for role, epoch in [("primary", 2**40), ("replica", 2**40), ("replica", 1)]:
                fake = dealer(ctx, c.address, f"s-fake-{role}-{epoch}".encode())
                claim = {"partition": 0, "epoch": epoch, "role": role, "lsn": 10**9}
                fake.send_multipart(
                    [b"", *encode(Route(MsgType.REGISTER), {"address": "", "claim": claim})]
                )
                if role == "primary":
                    name = f"s-fake-{role}-{epoch}"
                    held = await asyncio.to_thread(
                        c.wait_for,
                        lambda s, name=name: any(
                            h["node"] == name for h in s["partitions"][0].get("held_copies", [])
                        ),
                        10,
                        "the fake primary claim to be held",
                    )
                    assert held["partitions"][0]["primary"] == before["partitions"][0]["primary"]
                else:
                    got = recv_until(fake, lambda r, h: r.mtype is MsgType.ASSIGN, 5)
                    assert got is not None and got[1]["role"] == "spare", (role, epoch, got)
                fake.close(0)
        finally:
            ctx.term()
        after = await asyncio.to_thread(c.wait_healthy, 10)
        assert [(p["epoch"], p["primary"]) for p in after["partitions"]] == [
            (p["epoch"], p["primary"]) for p in before["partitions"]
        ]
        async with zps.connect(c.address, timeout=10) as ps:
            assert np.array_equal(await ps.pull_rows(EMB, ids), values)


@pytest.mark.timeout(60)
async def test_a_registered_fake_shard_cannot_forge_broker_control_messages() -> None:
    with LocalCluster(partitions=2, shards=4, replication=2, log_level="error") as c:
        ids, values = await seeded(c)
        status = await asyncio.to_thread(c.status)
        primary = next(s for s in status["shards"] if s["role"] == "primary")
        ctx = zmq.Context()
        try:
            fake = dealer(ctx, c.address, b"s-fake-forger")
            fake.send_multipart([b"", *encode(Route(MsgType.REGISTER), {"address": ""})])
            assert recv_until(fake, lambda r, h: r.mtype is MsgType.ASSIGN, 5)
            forged = encode(Route(MsgType.ASSIGN), {"role": "spare", "partition": None})
            fake.send_multipart([primary["node"].encode(), b"", *forged])
            time.sleep(0.5)
            fake.close(0)
        finally:
            ctx.term()
        async with zps.connect(c.address, timeout=5) as ps:
            assert np.array_equal(await ps.pull_rows(EMB, ids), values)


@pytest.mark.timeout(60)
async def test_a_fake_replica_that_stops_acknowledging_does_not_stall_writes() -> None:
    with LocalCluster(partitions=2, shards=4, replication=2, log_level="error") as c:
        ids, values = await seeded(c)
        status = await asyncio.to_thread(c.status)
        primary = next(s for s in status["shards"] if s["role"] == "primary")
        p, epoch = primary["partition"], status["partitions"][primary["partition"]]["epoch"]
        ctx = zmq.Context()
        try:
            fake = dealer(ctx, primary["address"], b"s-fake-replica")
            fake.send_multipart(encode(Route(MsgType.SUBSCRIBE), {"partition": p, "epoch": epoch}))
            # Only shards the broker made replicas of this partition may subscribe.
            refused = recv_until(fake, lambda r, h: r.mtype is MsgType.BYE, 5)
            assert refused is not None, "a stranger was sent a snapshot"
            fake.send_multipart(encode(Route(MsgType.ACK), {"lsn": 10**9, "epoch": epoch}))
            fake.close(0)  # and silent from now on
        finally:
            ctx.term()
        async with zps.connect(c.address, timeout=5) as ps:
            mine = ids[partitions_of_ids(ids, ps.cluster_map) == p]
            await ps.push_rows(EMB, mine, np.ones((mine.size, 4)))  # acknowledged, not stalled
            assert np.array_equal(await ps.pull_rows(EMB, mine), values[: mine.size] - 1)


@pytest.mark.timeout(60)
async def test_the_dedup_record_of_failed_pushes_is_bounded_in_bytes() -> None:
    with LocalCluster(partitions=2, shards=2, replication=1, log_level="error") as c:
        await seeded(c)
        status = await asyncio.to_thread(c.status)
        primary = next(s for s in status["shards"] if s["partition"] == 0)
        epoch = status["partitions"][0]["epoch"]
        before = rss_mb(primary["pid"])
        ctx = zmq.Context()
        try:
            sock = dealer(ctx, c.address, b"c-dedup")
            big = "x" * 900_000
            for seq in range(150):
                op = {"op": "push_rows", "t": EMB, "ids": [0, big, [1], 0]}
                header = {"cid": b"c-dedup", "seq": seq, "ops": [op]}
                route = Route(MsgType.REQUEST, 0, epoch, seq)
                sock.send_multipart([route.pack(), msgpack.packb(header), bytes(8)])
                assert recv_until(sock, lambda r, h, seq=seq: r.req_id == seq, 5), "no reply"
            sock.close(0)
        finally:
            ctx.term()
        await asyncio.sleep(0.5)
        grew = rss_mb(primary["pid"]) - before
        assert grew < RSS_BOUND_MB, f"the primary grew by {grew:.0f} MB"


@pytest.mark.timeout(60)
async def test_the_broker_forgets_departed_fake_shards() -> None:
    with LocalCluster(partitions=2, shards=2, replication=1, log_level="error") as c:
        broker = c.broker().pid
        before = rss_mb(broker)
        ctx = zmq.Context()
        try:
            key = "k" * 900_000
            for i in range(150):
                fake = dealer(ctx, c.address, f"s-fake-{i}".encode())
                head = {"address": "", "public_key": key}
                fake.send_multipart([b"", *encode(Route(MsgType.REGISTER), head)])
                assert recv_until(fake, lambda r, h: r.mtype is MsgType.ASSIGN, 5)
                fake.send_multipart([b"", *encode(Route(MsgType.BYE), {})])
                fake.close(0)
        finally:
            ctx.term()
        status = await asyncio.to_thread(
            c.wait_for, lambda s: len(s["shards"]) == 2, 10, "the fakes to leave"
        )
        assert len(status["shards"]) == 2
        grew = rss_mb(broker) - before
        assert grew < RSS_BOUND_MB, f"the broker grew by {grew:.0f} MB"


@pytest.mark.timeout(60)
async def test_an_unpaced_flood_leaves_broker_memory_bounded() -> None:
    with LocalCluster(partitions=2, shards=2, replication=1, log_level="error") as c:
        broker = c.broker().pid
        before = rss_mb(broker)
        ctx = zmq.Context()
        try:
            sock = dealer(ctx, c.address, b"c-flood")
            junk = [b"junk", bytes(3_000)]
            for _ in range(100_000):
                sock.send_multipart(junk)
            sock.send_multipart(encode(Route(MsgType.STATUS), {}))
            assert recv_until(sock, lambda r, h: r.mtype is MsgType.STATUS, 30)
            sock.close(0)
        finally:
            ctx.term()
        await asyncio.sleep(0.5)
        grew = rss_mb(broker) - before
        assert grew < RSS_BOUND_MB, f"the broker grew by {grew:.0f} MB"
