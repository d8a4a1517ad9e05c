"""The wire codec: round trips, zero-copy decoding, and "garbage in -> ProtocolError only"."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zps.errors import ProtocolError
from zps.protocol.codec import (
    CODEC_RAW,
    CODEC_ZSTD,
    MAGIC,
    NO_COMPRESSION,
    PROTOCOL_VERSION,
    ROUTE,
    TRAFFIC,
    WIRE_DTYPES,
    BufferLike,
    CompressPolicy,
    Encoder,
    MsgType,
    Route,
    array_from,
    decode,
    encode,
    unpack_route,
)

MAX = 1 << 30
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- strategies -------------------------------------------------------------

routes = st.builds(
    Route,
    st.sampled_from(list(MsgType)),
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
headers = st.dictionaries(st.text(max_size=10), msgpack_values, max_size=6)

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(sorted(WIRE_DTYPES))))
    shape = tuple(draw(shapes))
    n = int(np.prod(shape))
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (NaN payloads from random bytes compare by bits)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def roundtrip(
    route: Route, header: dict[str, Any], arrs: list[np.ndarray], policy: CompressPolicy
) -> tuple[list[np.ndarray], list[list[Any]], list[BufferLike]]:
    enc = Encoder(policy)
    descs = [enc.array(a) for a in arrs]
    frames = enc.build(route, {**header, "arrays": descs})
    msg = decode(frames)
    assert msg.route == route
    assert {k: v for k, v in msg.header.items() if k != "arrays"} == header
    out = [array_from(d, msg.payloads, max_bytes=MAX) for d in msg.header["arrays"]]
    return out, descs, frames


# ---- route ------------------------------------------------------------------


@given(routes)
def test_route_round_trip(route: Route) -> None:
    packed = route.pack()
    assert len(packed) == ROUTE.size == 20
    assert unpack_route(packed) == route
    assert unpack_route(memoryview(packed)) == route


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"ZP",
        Route(MsgType.REQUEST).pack()[:-1],
        Route(MsgType.REQUEST).pack() + b"\0",
        ROUTE.pack(b"XX", PROTOCOL_VERSION, 1, 0, 0, 0),
        ROUTE.pack(MAGIC, PROTOCOL_VERSION + 1, 1, 0, 0, 0),
        ROUTE.pack(MAGIC, PROTOCOL_VERSION, 0, 0, 0, 0),
        ROUTE.pack(MAGIC, PROTOCOL_VERSION, 200, 0, 0, 0),
    ],
)
def test_bad_route_frames_are_protocol_errors(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        unpack_route(frame)


# ---- round trip -------------------------------------------------------------


@FAST
@given(
    routes,
    headers,
    st.lists(arrays(), max_size=4),
    st.sampled_from([CompressPolicy(), NO_COMPRESSION, CompressPolicy(min_bytes=0)]),
)
def test_round_trip_random_arrays(
    route: Route, header: dict[str, Any], arrs: list[np.ndarray], policy: CompressPolicy
) -> None:
    out, descs, frames = roundtrip(route, header, arrs, policy)
    assert len(frames) == 2 + len(arrs)
    for a, b, d in zip(arrs, out, descs, strict=True):
        assert same(a, b)
        assert not b.flags.writeable
        if not policy.enabled:
            assert d[3] == CODEC_RAW


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("policy", [CompressPolicy(), NO_COMPRESSION], ids=["zstd", "raw"])
def test_large_frames_compress_only_where_it_pays(dtype: str, policy: CompressPolicy) -> None:
    rng = np.random.default_rng(1)
    zeros = np.zeros((128, 1024), dtype=dtype)
    ids = (np.arange(100_000) % 7).astype(dtype)
    noise = rng.normal(size=(64, 1024)).astype(np.float32)
    small = np.zeros(100, dtype=dtype)  # under min_bytes: never worth a zstd call
    out, descs, frames = roundtrip(Route(MsgType.REPLY), {}, [zeros, ids, noise, small], policy)
    for a, b in zip([zeros, ids, noise, small], out, strict=True):
        assert same(a, b)
    want = CODEC_ZSTD if policy.enabled else CODEC_RAW
    assert [d[3] for d in descs] == [want, want, CODEC_RAW, CODEC_RAW]
    if policy.enabled:
        assert len(frames[2]) < zeros.nbytes // 10
        assert len(frames[4]) == noise.nbytes


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2), ()])
def test_empty_and_scalar_arrays(shape: tuple[int, ...]) -> None:
    a = np.ones(shape, dtype=np.float64)
    out, descs, _ = roundtrip(Route(MsgType.REPLY), {"x": 1}, [a], CompressPolicy(min_bytes=0))
    assert same(a, out[0])
    assert descs[0][2] == list(shape)


def test_non_contiguous_input_is_sent_as_its_values() -> None:
    a = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    out, _, _ = roundtrip(Route(MsgType.REPLY), {}, [a], NO_COMPRESSION)
    assert np.array_equal(out[0], a)


@pytest.mark.parametrize("dtype", ["bool", "int8", "complex64", "object", "<U3"])
def test_encoder_refuses_other_dtypes(dtype: str) -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        Encoder().array(np.zeros(3, dtype=dtype))


def test_encode_without_payloads() -> None:
    frames = encode(Route(MsgType.HELLO, 3, 4, 5), {"a": [1, 2]})
    msg = decode(frames)
    assert msg.route == Route(MsgType.HELLO, 3, 4, 5)
    assert msg.header == {"a": [1, 2]}
    assert list(msg.payloads) == []


def test_raw_arrays_are_read_only_zero_copy_views() -> None:
    a = np.arange(1000, dtype=np.float32)
    frame = a.tobytes()
    out = array_from([0, "float32", [10, 100], CODEC_RAW], [frame], max_bytes=MAX)
    assert np.shares_memory(out, np.frombuffer(frame, dtype=np.uint8))
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0, 0] = 1.0
    # Even over a writable buffer the decoded array is read-only...
    buf = bytearray(frame)
    view = array_from([0, "float32", [1000], CODEC_RAW], [buf], max_bytes=MAX)
    assert not view.flags.writeable
    # ...and still a view: the receiver's buffer is not copied.
    buf[0:4] = struct.pack("<f", 42.0)
    assert view[0] == 42.0


def test_zstd_arrays_are_read_only() -> None:
    a = np.zeros(10_000, dtype=np.int64)
    out, descs, _ = roundtrip(Route(MsgType.REPLY), {}, [a], CompressPolicy())
    assert descs[0][3] == CODEC_ZSTD
    assert not out[0].flags.writeable


# ---- limits -----------------------------------------------------------------


def test_zstd_bomb_is_refused_before_inflating() -> None:
    # A real zstd frame header declaring 2**40 bytes of content: checked before any allocation.
    cobj = zstandard.ZstdCompressor().compressobj(size=2**40)
    bomb = cobj.compress(b"\0" * 1024) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    assert zstandard.frame_content_size(bomb) == 2**40
    with pytest.raises(ProtocolError, match="exceeds limit"):
        array_from([0, "uint8", [2**20, 2**20], CODEC_ZSTD], [bomb], max_bytes=MAX)
    # Under a shape that the limit allows, the declared size must match exactly.
    with pytest.raises(ProtocolError, match="declares"):
        array_from([0, "uint8", [1024], CODEC_ZSTD], [bomb], max_bytes=MAX)


def test_zstd_frame_without_declared_size_is_refused() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)
    with pytest.raises(ProtocolError):
        array_from([0, "uint8", [64], CODEC_ZSTD], [frame], max_bytes=MAX)


def test_zstd_frame_that_lies_about_its_size_is_refused() -> None:
    # The header says 64 bytes; the compressed data holds 32.
    real = zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * 32)
    liar = zstandard.ZstdCompressor().compress(b"\1" * 64)
    spliced = liar[:6] + real[5:]
    with pytest.raises(ProtocolError):
        array_from([0, "uint8", [64], CODEC_ZSTD], [spliced], max_bytes=MAX)


def test_array_limit_and_header_limit() -> None:
    with pytest.raises(ProtocolError, match="exceeds limit"):
        array_from([0, "float64", [2**39], CODEC_RAW], [b""], max_bytes=MAX)
    with pytest.raises(ProtocolError, match="exceeds limit"):
        array_from([0, "float32", [1000], CODEC_RAW], [bytes(4000)], max_bytes=3999)
    assert array_from([0, "float32", [1000], CODEC_RAW], [bytes(4000)], max_bytes=4000).size == 1000
    big = [Route(MsgType.REQUEST).pack(), msgpack.packb({"x": b"a" * 2000})]
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(big, max_header_bytes=1000)
    assert decode(big, max_header_bytes=4000).header == {"x": b"a" * 2000}


@pytest.mark.parametrize(
    "desc",
    [
        None,
        "x",
        {"frame": 0},
        [0, "float32", [2]],
        [0, "float32", [2], 0, 0],
        [1, "float32", [2], 0],
        [-1, "float32", [2], 0],
        [True, "float32", [2], 0],
        [0.0, "float32", [2], 0],
        ["0", "float32", [2], 0],
        [0, "float31", [2], 0],
        [0, "bool", [8], 0],
        [0, "object", [1], 0],
        [0, b"float32", [2], 0],
        [0, None, [2], 0],
        [0, "float32", 2, 0],
        [0, "float32", (2,), 0],
        [0, "float32", [2.0], 0],
        [0, "float32", [True, 2], 0],
        [0, "float32", [-2], 0],
        [0, "float32", [-1, -2], 0],  # the product matches the frame's 8 bytes
        [0, "float32", [1] * 9, 0],
        [0, "float32", [2**40], 0],
        [0, "float32", [2**39, 2**39], 0],
        [0, "float32", [3], 0],
        [0, "float32", [1], 0],
        [0, "float32", [2], 2],
        [0, "float32", [2], "raw"],
        [0, "float32", [2], None],
        [0, "float32", [2], CODEC_ZSTD],
    ],
)
def test_bad_descriptors_are_protocol_errors(desc: object) -> None:
    frame = np.zeros(2, dtype=np.float32).tobytes()
    with pytest.raises(ProtocolError):
        array_from(desc, [frame], max_bytes=MAX)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [Route(MsgType.REQUEST).pack()],
        [Route(MsgType.REQUEST).pack(), b""],
        [Route(MsgType.REQUEST).pack(), b"\xc1"],
        [Route(MsgType.REQUEST).pack(), msgpack.packb([1, 2])],
        [Route(MsgType.REQUEST).pack(), msgpack.packb(7)],
        [Route(MsgType.REQUEST).pack(), msgpack.packb({1: 2})],
        [Route(MsgType.REQUEST).pack(), msgpack.packb({"a": 1}) + b"\x00"],
        [Route(MsgType.REQUEST).pack(), msgpack.packb({"a": 1})[:-1]],
        [b"garbage", msgpack.packb({})],
    ],
)
def test_bad_messages_are_protocol_errors(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode(frames)


# ---- garbage in -> ProtocolError only ---------------------------------------


def decode_all(frames: list[BufferLike]) -> list[np.ndarray]:
    """What a receiver does: decode, then every array descriptor it can find."""
    msg = decode(frames)
    descs = msg.header.get("arrays", [])
    if not isinstance(descs, list):
        descs = [descs]
    out = []
    for d in descs:
        arr = array_from(d, msg.payloads, max_bytes=1 << 20)
        # Anything returned is well-formed: its size matches its descriptor.
        assert isinstance(d, list)
        assert arr.dtype.name == d[1] and list(arr.shape) == d[2]
        assert arr.nbytes <= 1 << 20
        out.append(arr)
    return out


def must_not_crash(frames: list[BufferLike]) -> None:
    with contextlib.suppress(ProtocolError):
        decode_all(frames)


@FAST
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_frames_only_raise_protocol_error(frames: list[bytes]) -> None:
    must_not_crash(list(frames))


@FAST
@given(st.binary(max_size=200), st.lists(st.binary(max_size=64), max_size=3))
def test_random_header_after_valid_route(header: bytes, payloads: list[bytes]) -> None:
    must_not_crash([Route(MsgType.REQUEST, 0, 1, 2).pack(), header, *payloads])


@FAST
@given(msgpack_values, st.lists(st.binary(max_size=64), max_size=3))
def test_random_descriptors_only_raise_protocol_error(desc: Any, payloads: list[bytes]) -> None:
    frames = [Route(MsgType.REQUEST).pack(), msgpack.packb({"arrays": [desc]}), *payloads]
    must_not_crash(frames)


descriptor_parts = st.tuples(
    st.integers(-2, 4) | msgpack_values,
    st.sampled_from([*sorted(WIRE_DTYPES), "bool", "float128", ""]) | msgpack_values,
    st.lists(st.sampled_from([0, 1, 3, 2**20, 2**39, 2**40, -1]), max_size=4) | msgpack_values,
    st.sampled_from([CODEC_RAW, CODEC_ZSTD, 2, -1, 1.0]) | msgpack_values,
)


@FAST
@given(descriptor_parts)
def test_mangled_descriptor_fields(parts: tuple[Any, Any, Any, Any]) -> None:
    enc = Encoder(CompressPolicy(min_bytes=0))
    enc.array(np.zeros(64, dtype=np.float32))
    enc.array(np.arange(8, dtype=np.int64))
    frames = enc.build(Route(MsgType.REQUEST), {"arrays": [list(parts)]})
    must_not_crash(frames)


def valid_message() -> list[BufferLike]:
    enc = Encoder(CompressPolicy())
    arrays = [
        enc.array(np.zeros((100, 256), dtype=np.float32)),  # zstd
        enc.array(np.arange(10, dtype=np.int64)),  # raw, small
        enc.array(np.random.default_rng(0).normal(size=5000).astype(np.float32)),  # raw, large
    ]
    frames = enc.build(Route(MsgType.REQUEST, 1, 2, 3), {"arrays": arrays, "ops": [{"op": "x"}]})
    assert [a[3] for a in arrays] == [CODEC_ZSTD, CODEC_RAW, CODEC_RAW]
    return [bytes(f) for f in frames]


VALID = valid_message()


def test_the_valid_message_decodes() -> None:
    out = decode_all(list(VALID))
    assert [a.shape for a in out] == [(100, 256), (10,), (5000,)]
    assert not out[0].any() and out[1].tolist() == list(range(10))


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "extend", "drop", "dup"]),
        st.integers(0, len(VALID) - 1),
        st.integers(0, 2**16),
        st.integers(1, 255),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=80, deadline=None)
@given(mutations)
def test_mutated_valid_messages_only_raise_protocol_error(
    muts: list[tuple[str, int, int, int]],
) -> None:
    frames = [bytearray(f) for f in VALID]
    for kind, which, pos, byte in muts:
        if not frames:
            break
        which %= len(frames)
        f = frames[which]
        if kind == "flip" and f:
            f[pos % len(f)] ^= byte
        elif kind == "truncate":
            del f[pos % (len(f) + 1) :]
        elif kind == "extend":
            f.extend(bytes([byte]) * (pos % 64 + 1))
        elif kind == "drop":
            del frames[which]
        elif kind == "dup":
            frames.insert(which, bytearray(f))
    must_not_crash([bytes(f) for f in frames])


@FAST
@given(st.binary(min_size=1, max_size=400), st.integers(0, 2**41))
def test_random_zstd_payload_with_any_declared_size(payload: bytes, n: int) -> None:
    frames = [Route(MsgType.REQUEST).pack(), msgpack.packb({"arrays": [[0, "uint8", [n], 1]]})]
    must_not_crash([*frames, payload])
    # and a genuine zstd frame whose content size differs from the shape
    real = zstandard.ZstdCompressor().compress(payload)
    if n != len(payload):
        with pytest.raises(ProtocolError):
            decode_all([*frames, real])
    else:
        assert decode_all([*frames, real])[0].tobytes() == payload


def test_traffic_policy_sends_floats_raw_and_still_compresses_ids() -> None:
    zeros = np.zeros((128, 1024), dtype=np.float32)  # would compress, but floats go raw
    ids = (np.arange(100_000) % 7).astype(np.int64)
    out, descs, frames = roundtrip(Route(MsgType.REQUEST), {}, [zeros, ids], TRAFFIC)
    assert [d[3] for d in descs] == [CODEC_RAW, CODEC_ZSTD]
    assert len(frames[2]) == zeros.nbytes
    assert same(out[0], zeros) and same(out[1], ids)
