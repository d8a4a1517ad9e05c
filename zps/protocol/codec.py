"""Pure encoding and decoding of zps multipart messages.

A message, after any ROUTER envelope frames, is::

    [route][header][payload 0][payload 1]...

* ``route`` is a fixed 20-byte struct (:data:`ROUTE`): magic ``b"ZP"``, protocol
  version, message type, partition, epoch and request id.  The broker reads
  only this frame; it never touches the header or payloads.
* ``header`` is a msgpack map.
* payload frames hold raw array bytes, zstd-compressed per frame when that
  shrinks the frame enough to pay.  Arrays are described in the header by a
  4-item list ``[frame index, dtype, shape, codec]`` and decoded as zero-copy
  ``np.frombuffer`` views over the received frames (read-only).

Rule: :func:`decode` and :func:`array_from` either return a well-formed value
or raise :class:`~zps.errors.ProtocolError`; never any other exception, for
any input.  This module does no I/O.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zstandard

from zps.errors import ProtocolError

PROTOCOL_VERSION = 1
MAGIC = b"ZP"
ROUTE = struct.Struct("<2sBBiIQ")
NO_PARTITION = -1

#: dtypes that may travel as arrays; anything else is a protocol error.
WIRE_DTYPES: frozenset[str] = frozenset(
    {"float16", "float32", "float64", "int32", "int64", "uint8", "uint32", "uint64"}
)

#: The numpy dtype of each wire dtype name (a dict lookup per array, not np.dtype()).
_WIRE_NP: dict[str, np.dtype[Any]] = {name: np.dtype(name) for name in WIRE_DTYPES}
#: And back: the wire name of each native-order numpy dtype that may travel.
_WIRE_NAMES: dict[np.dtype[Any], str] = {d: name for name, d in _WIRE_NP.items()}

CODEC_RAW = 0
CODEC_ZSTD = 1

#: Default largest message a process accepts: zmq's MAXMSGSIZE (which zmq checks
#: per frame, disconnecting a peer that sends a larger one), and the bound a shard
#: puts on a whole reply.  64 MiB: four times :data:`MESSAGE_BUDGET`, so every
#: message zps builds fits with room for its header, while a broken or hostile
#: peer can make a process allocate no more than this for one frame.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
#: Payload bytes one message built by zps carries at most: a client cuts a call
#: into messages whose request and expected reply payloads each stay within it
#: (configurable: ``[client] message_budget``).  Snapshot chunks (8 MiB) and
#: replication records (a client's request as sent) stay within it too.
MESSAGE_BUDGET = 16 << 20


class MsgType(enum.IntEnum):
    """Every message type on the wire."""

    REQUEST = 1  # client -> shard (via broker): data operations
    REPLY = 2  # shard -> client (via broker), or broker -> client on routing errors
    HELLO = 3  # client -> broker: join, ask for the cluster map
    MAP = 4  # broker -> client/shard: the cluster map
    HEARTBEAT = 5  # any direction; any traffic counts as a heartbeat too
    REGISTER = 6  # shard -> broker
    ASSIGN = 7  # broker -> shard: partition, role, epoch
    STATUS = 8  # client -> broker: ask for the status report; reply has the same type
    BYE = 9  # orderly departure; from a primary to a replica: subscription refused
    SUBSCRIBE = 10  # replica -> primary: send me a snapshot, then the stream
    SNAPSHOT = 11  # primary -> replica: the whole partition at one LSN
    REPLICATE = 12  # primary -> replica: one message that changed state
    ACK = 13  # replica -> primary: applied up to this LSN
    CLOCK = 14  # client <-> broker: join / tick / leave of sync and ssp training
    TASK = 15  # client <-> broker: data tasks (create, next, done, release)
    SNAPSHOT_CHUNK = 16  # primary -> replica: one bounded piece of a snapshot
    SNAPSHOT_ACK = 17  # replica -> primary: this snapshot chunk arrived


BufferLike = bytes | bytearray | memoryview
_MSG_TYPES: dict[int, MsgType] = {int(t): t for t in MsgType}


class VersionMismatchError(ProtocolError):
    """A route frame of another protocol version.

    The frame's layout up to and including the version byte (magic ``b"ZP"``, then the
    version) is the same in every version, so any two zps processes can tell each
    other which version they speak.  The remaining fields are those of this version's
    layout (meaningful if only the header changed): a reply echoes ``req_id``.
    """

    def __init__(
        self, version: int, partition: int = NO_PARTITION, epoch: int = 0, req_id: int = 0
    ) -> None:
        self.version, self.ours = version, PROTOCOL_VERSION
        self.partition, self.epoch, self.req_id = partition, epoch, req_id
        super().__init__(
            f"the peer speaks protocol version {version}; this process speaks {self.ours}"
        )


@dataclass(frozen=True, slots=True)
class Route:
    mtype: MsgType
    partition: int = NO_PARTITION
    epoch: int = 0
    req_id: int = 0

    def pack(self) -> bytes:
        return ROUTE.pack(
            MAGIC, PROTOCOL_VERSION, self.mtype, self.partition, self.epoch, self.req_id
        )


def unpack_route(buf: BufferLike) -> Route:
    """Parse a route frame, raising ProtocolError on anything malformed."""
    if len(buf) != ROUTE.size:
        raise ProtocolError(f"route frame must be {ROUTE.size} bytes, got {len(buf)}")
    magic, version, mtype, partition, epoch, req_id = ROUTE.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} in route frame")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(version, partition, epoch, req_id)
    kind = _MSG_TYPES.get(mtype)  # a dict lookup: calling the enum costs more than parsing
    if kind is None:
        raise ProtocolError(f"unknown message type {mtype}")
    return Route(kind, partition, epoch, req_id)


@dataclass(frozen=True, slots=True)
class Message:
    route: Route
    header: dict[str, Any]
    payloads: Sequence[BufferLike]


@dataclass(frozen=True, slots=True)
class CompressPolicy:
    """When a payload frame is worth compressing.

    Frames smaller than ``min_bytes`` go raw.  Larger ones are compressed only
    if a sample of them shrinks below ``max_ratio`` (float32 gradients
    barely compress; ids and zero-heavy data do), so the check costs little.
    ``floats=False`` sends float arrays raw without sampling them.
    """

    min_bytes: int = 64 * 1024
    max_ratio: float = 0.75
    level: int = 1
    sample_bytes: int = 16 * 1024
    enabled: bool = True
    floats: bool = True


NO_COMPRESSION = CompressPolicy(enabled=False)
#: For request and reply traffic: parameters and gradients are float arrays
#: that shrink by under 10% (a 16 KiB float32 sample compresses to 92% at level
#: 1 and costs about 30 us), so only integer arrays (ids) are tried.  Snapshots
#: and checkpoints keep the default: a fresh table's zeros do compress.
TRAFFIC = CompressPolicy(floats=False)


class Encoder:
    """Collects payload frames for one message and builds it."""

    __slots__ = ("_compressor", "_policy", "frames")

    def __init__(self, policy: CompressPolicy = NO_COMPRESSION) -> None:
        self._policy = policy
        self._compressor: zstandard.ZstdCompressor | None = None
        self.frames: list[BufferLike] = []

    def array(self, arr: np.ndarray) -> list[Any]:
        """Add ``arr`` as a payload frame; return its header descriptor."""
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:  # not ascontiguousarray always: it makes 0-d arrays 1-d
            arr = np.ascontiguousarray(arr)
        # A dict lookup first: dtype.name is a slow property in numpy 2.
        dtype = _WIRE_NAMES.get(arr.dtype) or arr.dtype.name
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype {dtype} cannot be sent; use one of {sorted(WIRE_DTYPES)}")
        raw = arr.data.cast("B") if arr.size else b""
        codec = CODEC_RAW
        data: BufferLike = raw
        policy = self._policy
        if (
            policy.enabled
            and len(raw) >= policy.min_bytes
            and (policy.floats or arr.dtype.kind != "f")
        ):
            if self._compressor is None:
                self._compressor = zstandard.ZstdCompressor(level=policy.level)
            sample = raw[: policy.sample_bytes]
            if len(self._compressor.compress(sample)) <= policy.max_ratio * len(sample):
                packed = self._compressor.compress(raw)
                if len(packed) <= policy.max_ratio * len(raw):
                    data, codec = packed, CODEC_ZSTD
        self.frames.append(data)
        return [len(self.frames) - 1, dtype, list(arr.shape), codec]

    def build(self, route: Route, header: dict[str, Any]) -> list[BufferLike]:
        return [route.pack(), msgpack.packb(header, use_bin_type=True), *self.frames]


def encode(route: Route, header: dict[str, Any]) -> list[BufferLike]:
    """A message without payload frames."""
    return [route.pack(), msgpack.packb(header, use_bin_type=True)]


def decode(
    frames: Sequence[BufferLike], max_header_bytes: int = 1 << 20, *, route: Route | None = None
) -> Message:
    """Parse ``[route, header, payloads...]``; ProtocolError on anything malformed.
    ``route``: the route frame, parsed already by the caller (not parsed again)."""
    if len(frames) < 2:
        raise ProtocolError(f"message has {len(frames)} frames; needs route and header")
    if route is None:
        route = unpack_route(frames[0])
    raw = frames[1]
    if len(raw) > max_header_bytes:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {max_header_bytes}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many types for garbage
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    return Message(route, header, frames[2:])


def array_from(desc: object, payloads: Sequence[BufferLike], *, max_bytes: int) -> np.ndarray:
    """Decode the array that descriptor ``desc`` names, validating everything.

    Raw frames become zero-copy read-only views; zstd frames are decompressed
    into a buffer of exactly the declared size, never more.
    """
    if not isinstance(desc, list) or len(desc) != 4:
        raise ProtocolError(
            f"array descriptor must be [frame, dtype, shape, codec], got {desc!r}"[:200]
        )
    index, dtype, shape, codec = desc
    if type(index) is not int or not 0 <= index < len(payloads):
        raise ProtocolError(
            f"array frame index {index!r} out of range (message has {len(payloads)} payload frames)"
        )
    np_dtype = _WIRE_NP.get(dtype) if type(dtype) is str else None
    if np_dtype is None:
        raise ProtocolError(f"array dtype {dtype!r} is not allowed")
    if type(shape) is not list or len(shape) > 8:
        raise ProtocolError(f"array shape {shape!r} is invalid"[:200])
    for d in shape:  # a loop, not all() over a generator: this runs for every array
        if type(d) is not int or not 0 <= d < 1 << 40:
            raise ProtocolError(f"array shape {shape!r} is invalid"[:200])
    nbytes = math.prod(shape) * np_dtype.itemsize
    if nbytes > max_bytes:
        raise ProtocolError(f"array of shape {shape} ({nbytes} bytes) exceeds limit {max_bytes}")
    frame = payloads[index]
    if type(codec) is not int:
        raise ProtocolError(f"array codec must be an integer, got {codec!r}"[:120])
    if codec == CODEC_RAW:
        if len(frame) != nbytes:
            raise ProtocolError(
                f"array frame has {len(frame)} bytes; shape {shape} of {dtype} needs {nbytes}"
            )
        buf: BufferLike = frame
    elif codec == CODEC_ZSTD:
        # Check the size the frame declares before zstd allocates for it: a
        # hostile frame could otherwise claim gigabytes.
        try:
            declared = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as e:
            raise ProtocolError(f"bad zstd frame: {e}") from None
        if declared != nbytes:
            raise ProtocolError(
                f"zstd frame declares {declared} bytes; shape {shape} of {dtype} needs {nbytes}"
            )
        try:
            buf = zstandard.ZstdDecompressor().decompress(frame, max_output_size=nbytes)
        except zstandard.ZstdError as e:
            raise ProtocolError(f"bad zstd frame: {e}") from None
        if len(buf) != nbytes:
            raise ProtocolError(
                f"zstd frame inflates to {len(buf)} bytes; shape {shape} of {dtype} needs {nbytes}"
            )
    else:
        raise ProtocolError(f"unknown codec {codec!r}")
    arr = np.frombuffer(buf, dtype=np_dtype).reshape(shape)
    arr.flags.writeable = False  # a bytearray or writable frame must not make it writable
    return arr
