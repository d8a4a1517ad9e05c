"""The same-host shared-memory path's parts (zps.shm): the arena, reading, the frames."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from zps import shm
from zps.errors import ProtocolError
from zps.protocol.codec import Encoder, MsgType, Route, array_from, decode

pytestmark = pytest.mark.skipif(shm.host_key() is None, reason="no memfd or /proc here")

MiB = 1 << 20


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_arena_first_fit_free_and_budget() -> None:
    arena = shm.Arena(4 * MiB, "t")
    try:
        a = arena.put(_data(MiB))
        b = arena.put(_data(MiB, 1))
        assert a is not None and b is not None
        assert a[3] == 0 and b[3] > a[3]  # first fit, one after the other
        assert arena.put(_data(3 * MiB)) is None  # no room: None, never a wait
        assert arena.full == 1
        assert arena.free(a[5]) and not arena.free(a[5])  # unknown tokens are ignored
        c = arena.put(_data(MiB // 2))
        assert c is not None and c[3] == 0  # the freed room is reused first
        assert arena.live == 2
    finally:
        arena.close()


def test_arena_reclaims_old_regions_only_when_allowed() -> None:
    arena = shm.Arena(2 * MiB, "t", reclaim_after=1.0)
    try:
        a = arena.put(_data(MiB + MiB // 2), now=10.0)
        assert a is not None
        assert arena.put(_data(MiB), now=10.5) is None  # too young to reuse
        b = arena.put(_data(MiB), now=11.0)
        assert b is not None and arena.reclaimed == 1
    finally:
        arena.close()


def test_trim_gives_the_pages_above_the_last_region_back() -> None:
    arena = shm.Arena(8 * MiB, "t")
    try:
        a = arena.put(_data(MiB))
        b = arena.put(_data(3 * MiB))
        assert a is not None and b is not None
        assert arena.trim() == 0  # everything below the top is in use
        arena.free(b[5])
        freed = arena.trim()
        assert 3 * MiB - 4096 <= freed <= 3 * MiB and arena.touched < 2 * MiB
        assert shm.Mapper().read(a).tobytes() == _data(MiB).tobytes()  # a is intact
        c = arena.put(_data(2 * MiB, 1))  # the removed pages come back as needed
        assert c is not None and shm.Mapper().read(c).tobytes() == _data(2 * MiB, 1).tobytes()
    finally:
        arena.close()


def test_read_copies_the_bytes_out() -> None:
    arena, mapper = shm.Arena(4 * MiB, "t"), shm.Mapper()
    try:
        data = _data(MiB + 7)
        d = arena.put(data)
        assert d is not None
        got = mapper.read(d)
        assert got.tobytes() == data.tobytes()
        arena.free(d[5])
        assert got.tobytes() == data.tobytes()  # a copy: the region's reuse cannot touch it
    finally:
        mapper.close()
        arena.close()


def test_a_freed_or_reused_region_is_refused_never_read() -> None:
    arena, mapper = shm.Arena(4 * MiB, "t"), shm.Mapper()
    try:
        d = arena.put(_data(MiB))
        assert d is not None
        arena.free(d[5])
        with pytest.raises(shm.ShmUnavailableError) as err:
            mapper.read(d)
        assert not err.value.permanent
        e = arena.put(_data(MiB, 2))  # the same bytes, another token
        assert e is not None and e[3] == d[3]
        with pytest.raises(shm.ShmUnavailableError):
            mapper.read(d)
        assert mapper.read(e).tobytes() == _data(MiB, 2).tobytes()
    finally:
        mapper.close()
        arena.close()


def test_reuse_inside_an_old_region_is_seen_through_the_old_head() -> None:
    """A new region that starts inside an old one's data: the old one's token is
    cleared when it is freed, so its reader finds out."""
    arena, mapper = shm.Arena(4 * MiB, "t"), shm.Mapper()
    try:
        small = arena.put(_data(1024))
        big = arena.put(_data(2 * MiB))
        assert small is not None and big is not None
        arena.free(small[5])
        arena.free(big[5])
        inner = arena.put(_data(MiB, 3))  # from offset 0: over both old regions' bytes
        assert inner is not None
        with pytest.raises(shm.ShmUnavailableError):
            mapper.read(big)
    finally:
        mapper.close()
        arena.close()


def test_descriptors_out_of_bounds_or_of_another_file_are_refused() -> None:
    arena, mapper = shm.Arena(MiB, "t"), shm.Mapper()
    try:
        d = arena.put(_data(1000))
        assert d is not None
        with pytest.raises(ProtocolError):
            mapper.read([d[0], d[1], d[2], MiB - 10, 1000, d[5]])
        with pytest.raises(shm.ShmUnavailableError):
            mapper.read([d[0], d[1], d[2] + 12345, 0, 1000, d[5]])  # another inode
        with pytest.raises(shm.ShmUnavailableError):
            mapper.read([d[0], 9999, d[2], 0, 1000, d[5]])  # no such fd
    finally:
        mapper.close()
        arena.close()


def test_a_descriptor_naming_a_pipe_neither_blocks_nor_reads_it() -> None:
    r, w = os.pipe()
    os.close(w)  # a reader of a pipe without a writer would wait for one
    try:
        ino = os.fstat(r).st_ino
        with pytest.raises(shm.ShmUnavailableError):
            shm.Mapper().read([os.getpid(), r, ino, 0, 10, 1])
    finally:
        os.close(r)


def _request(*arrays: np.ndarray) -> tuple[list[Any], list[np.ndarray]]:
    enc = Encoder()
    ops = [
        {"op": "push_dense", "t": "w", "chunk": i, "g": enc.array(a)} for i, a in enumerate(arrays)
    ]
    frames = enc.build(Route(MsgType.REQUEST, 0, 1, 7), {"cid": b"c", "seq": 1, "ops": ops})
    return list(frames), list(arrays)


def test_frames_round_trip_bit_identical_and_small_frames_stay_inline() -> None:
    sender = shm.SharedMemory(8 * MiB, "s", min_bytes=MiB)
    receiver = shm.SharedMemory(8 * MiB, "r", min_bytes=MiB)
    try:
        big = np.random.default_rng(1).standard_normal(MiB // 2).astype(np.float32)  # 2 MiB
        small = np.arange(1000, dtype=np.float32)
        frames, arrays = _request(big, small)
        out, descs = sender.outbound(frames, reply_ok=True, done=[5, 6])
        assert len(descs) == 1 and out[2] == b"" and out[3] is frames[3]
        header = msgpack.unpackb(out[1])
        assert header[shm.KEY]["r"] is True and header[shm.KEY]["done"] == [5, 6]
        got = receiver.inbound(out, decode(out).header)
        assert got.reply_ok and got.done == [5, 6]
        msg = decode(got.frames)
        assert shm.KEY not in msg.header and msg.header == got.header
        for op, a in zip(msg.header["ops"], arrays, strict=True):
            b = array_from(op["g"], msg.payloads, max_bytes=1 << 30)
            assert b.dtype == a.dtype and b.tobytes() == a.tobytes()
        # A re-send names the same regions and copies nothing.
        again, same = sender.outbound(frames, reuse=descs)
        assert same == descs and again[2] == b"" and sender.arena.puts == 1
        assert (
            decode(receiver.inbound(again, decode(again).header).frames).payloads[0]
            == (decode(frames).payloads[0])
        )
        sender.free(shm.tokens(descs))
        assert sender.arena.live == 0
    finally:
        sender.close()
        receiver.close()


def test_a_staged_copy_is_sent_from_its_region_and_freed_when_it_goes() -> None:
    sender = shm.SharedMemory(16 * MiB, "s", min_bytes=MiB)
    receiver = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        src = np.random.default_rng(2).standard_normal(MiB).astype(np.float32)  # 4 MiB
        copy = sender.stage(src[: MiB // 2])
        assert copy is not None and copy.tobytes() == src[: MiB // 2].tobytes()
        assert sender.arena.puts == 1 and sender.arena.live == 1
        src[:] = 0  # the caller's buffer, reused at once: the copy is not
        other = np.ones(MiB // 2, np.float32)  # not staged: copied into a region of its own
        frames, arrays = _request(copy, other)
        out, descs = sender.outbound(frames)
        assert out[2] == b"" and out[3] == b""
        assert sender.arena.puts == 2  # the staged copy was not copied again
        assert [d[0] for d in descs] == [0, 1]
        msg = decode(receiver.inbound(out, decode(out).header).frames)
        got = array_from(msg.header["ops"][0]["g"], msg.payloads, max_bytes=1 << 30)
        assert got.tobytes() == copy.tobytes()
        # A re-send names the staged region again, and the other by ``reuse``.
        again, same = sender.outbound(frames, reuse=descs)
        assert again[2] == b"" and again[3] == b"" and same == descs
        assert sender.arena.puts == 2
        sender.free(shm.tokens(descs))  # the staged region goes with its copy, not here
        assert sender.arena.live == 1
        # The region lives while anything refers to the copy's bytes (a slice, a frame).
        piece = copy[10:20]
        del copy, frames, arrays, out, again, msg, got
        sender.outbound(_request(np.zeros(4, np.float32))[0])  # notes are handled here
        assert sender.arena.live == 1
        assert piece.base is not None and not np.any(np.isnan(piece))
        del piece
        sender.outbound(_request(np.zeros(4, np.float32))[0])
        assert sender.arena.live == 0 and sender.staged_regions == 0
    finally:
        sender.close()
        receiver.close()


def test_a_staged_copy_dropped_in_another_thread_is_freed_by_the_owner() -> None:
    """pyzmq drops a zero-copy frame's buffer in its own thread: the finalizer only
    leaves a note, and the arena is changed in the owner's thread."""
    sp = shm.SharedMemory(8 * MiB, "s", min_bytes=MiB)
    try:
        holder = [sp.stage(np.ones(MiB // 2, np.float32))]
        assert holder[0] is not None and sp.arena.live == 1
        t = threading.Thread(target=holder.clear)
        t.start()
        t.join(10)
        assert sp.arena.live == 1 and sp.unstaged_regions == 1  # noted, not yet freed
        again = sp.stage(np.ones(MiB // 2, np.float32))  # the owner's next call frees it
        assert again is not None and sp.arena.live == 1 and sp.staged_regions == 1
    finally:
        sp.close()


def test_frames_read_with_stage_are_sent_on_with_no_copy() -> None:
    """A primary reads a write's frames from a client's memory into its own arena, and
    streams them to a replica from there."""
    client = shm.SharedMemory(8 * MiB, "c", min_bytes=MiB)
    primary = shm.SharedMemory(8 * MiB, "p", min_bytes=MiB, reclaim_after=0.5)
    replica = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        big = np.random.default_rng(4).standard_normal(MiB // 2).astype(np.float32)
        frames, _ = _request(big, np.arange(10, dtype=np.float32))
        sent, _ = client.outbound(frames)
        assert primary.inbound(sent, decode(sent).header, stage=MiB).frames[2] != b""
        assert primary.reserved == 0  # 2 MiB: more than the room given
        got = primary.inbound(sent, decode(sent).header, stage=4 * MiB)
        assert primary.reserved == 1 and primary.arena.puts == 1
        stream, descs = primary.outbound(got.frames)
        assert stream[2] == b"" and primary.arena.puts == 1 and primary.named == 1
        # Never reclaimed while in use, however old, nor freed by a reader's "done".
        assert primary.arena.put(np.zeros(7 * MiB, np.uint8), now=1e12) is None
        primary.free(shm.tokens(descs))
        msg = decode(replica.inbound(stream, decode(stream).header).frames)
        g = array_from(msg.header["ops"][0]["g"], msg.payloads, max_bytes=1 << 30)
        assert g.tobytes() == big.tobytes()
        del got, stream, msg
        primary.housekeeping()
        assert primary.arena.live == 0
    finally:
        for sm in (client, primary, replica):
            sm.close()


def test_a_full_budget_stages_nothing() -> None:
    sp = shm.SharedMemory(3 * MiB, "s", min_bytes=MiB)
    try:
        a = sp.stage(np.ones(MiB // 2, np.float32))
        assert a is not None
        assert sp.stage(np.ones(MiB // 2, np.float32)) is None  # the caller copies it itself
    finally:
        sp.close()


def test_done_frees_the_receivers_regions() -> None:
    sp = shm.SharedMemory(8 * MiB, "s", min_bytes=MiB)
    try:
        frames, _ = _request(np.zeros(MiB // 2, np.float32))
        _, descs = sp.outbound(frames)
        assert sp.arena.live == 1
        plain, _ = _request(np.zeros(4, np.float32))
        ask, _ = shm.SharedMemory(MiB, "c", min_bytes=MiB).outbound(plain, done=shm.tokens(descs))
        sp.inbound(ask, decode(ask).header)
        assert sp.arena.live == 0
    finally:
        sp.close()


def test_nothing_to_say_leaves_the_frames_alone() -> None:
    sp = shm.SharedMemory(8 * MiB, "s", min_bytes=MiB)
    try:
        frames, _ = _request(np.zeros(100, np.float32))
        out, descs = sp.outbound(frames)
        assert out == frames and descs == [] and not sp.arena_made  # no memfd made
        assert not sp.wants(frames)
    finally:
        sp.close()


def test_a_full_budget_sends_inline() -> None:
    sp = shm.SharedMemory(3 * MiB, "s", min_bytes=MiB)
    try:
        a = np.ones(MiB // 2, np.float32)  # 2 MiB each: the second does not fit
        frames, _ = _request(a, a * 2)
        out, descs = sp.outbound(frames)
        assert len(descs) == 1 and out[2] == b"" and len(out[3]) == 2 * MiB
        rx = shm.SharedMemory(MiB, "r")
        msg = decode(rx.inbound(out, decode(out).header).frames)
        b = array_from(msg.header["ops"][1]["g"], msg.payloads, max_bytes=1 << 30)
        assert np.array_equal(b, a * 2)
    finally:
        sp.close()


def test_another_host_or_the_path_off_refuses_descriptors() -> None:
    sender = shm.SharedMemory(8 * MiB, "s", min_bytes=MiB, host="elsewhere/1")
    try:
        frames, _ = _request(np.zeros(MiB // 2, np.float32))
        out, _ = sender.outbound(frames)
        rx = shm.SharedMemory(MiB, "r")
        with pytest.raises(shm.ShmUnavailableError) as err:
            rx.inbound(out, decode(out).header)
        assert err.value.permanent
        with pytest.raises(shm.ShmUnavailableError) as err:
            shm.OFF.inbound(out, decode(out).header)
        assert err.value.permanent
        # Without descriptors the path off only drops the key.
        plain, _ = _request(np.zeros(4, np.float32))
        ask, _ = sender.outbound(plain, reply_ok=True)
        got = shm.OFF.inbound(ask, decode(ask).header)
        assert not got.reply_ok and shm.KEY not in decode(got.frames).header
    finally:
        sender.close()


@pytest.mark.parametrize(
    "info",
    [
        "x",
        {"h": "h", "d": "x"},
        {"h": "h", "d": [[0, 1, 2]]},
        {"h": "h", "d": [[0, 1, 2, 3, 4, 5, -1]]},
        {"h": "h", "d": [[0, 1, 2, 3, 4, 5, True]]},
        {"h": "h", "d": [[0, 1, 2, 3, 4, 5, 6, -1]]},
        {"h": "h", "d": [[0, 1, 2, 3, 4, 5, 6, 4]]},  # a slice not 8-byte aligned
        {"h": "h", "d": [[0, 1, 2, 3, 4, 5, 6, 7, 8]]},
        {"h": "h", "done": ["a"]},
    ],
)
def test_malformed_descriptors_are_protocol_errors(info: object) -> None:
    rx = shm.SharedMemory(MiB, "r", host="h")
    frames, _ = _request(np.zeros(4, np.float32))
    header = {**decode(frames).header, shm.KEY: info}
    with pytest.raises(ProtocolError):
        rx.inbound(frames, header)


def test_a_frame_over_the_limit_is_refused_before_it_is_read() -> None:
    tx = shm.SharedMemory(8 * MiB, "s", min_bytes=MiB)
    rx = shm.SharedMemory(MiB, "r", max_frame_bytes=MiB)
    try:
        frames, _ = _request(np.zeros(MiB // 2, np.float32))  # 2 MiB
        out, _ = tx.outbound(frames)
        with pytest.raises(ProtocolError):
            rx.inbound(out, decode(out).header)
        assert rx.mapper.reads == 0
    finally:
        tx.close()


def test_a_descriptor_must_name_an_empty_frame() -> None:
    tx = shm.SharedMemory(8 * MiB, "s", min_bytes=MiB)
    rx = shm.SharedMemory(MiB, "r")
    try:
        frames, _ = _request(np.zeros(MiB // 2, np.float32))
        out, _ = tx.outbound(frames)
        out[2] = frames[2]  # the bytes inline too: which to believe?
        with pytest.raises(ProtocolError):
            rx.inbound(out, decode(out).header)
    finally:
        tx.close()


def test_disabled_by_env_and_by_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    assert shm.SharedMemory.create(0, "x") is None
    monkeypatch.setenv("ZPS_NO_SHM", "1")
    assert shm.SharedMemory.create(MiB, "x") is None
    monkeypatch.setenv("ZPS_NO_SHM", "0")
    sp = shm.SharedMemory.create(MiB, "x")
    assert sp is not None
    sp.close()


def test_off_where_the_tokens_order_cannot_be_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU that reorders memory, without the compiled barrier: the path stays off."""
    from zps.core import rows

    for machine in ("x86_64", "AMD64"):
        assert rows.memory_ordered(machine, barrier=False)
    for machine in ("aarch64", "ppc64le"):
        assert not rows.memory_ordered(machine, barrier=False)
        assert rows.memory_ordered(machine, barrier=True)
    monkeypatch.setattr(shm.memory, "memory_ordered", lambda: False)
    assert shm.SharedMemory.create(MiB, "x") is None


def test_barriers_between_tokens_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's token store comes before a barrier, and the reader's last token load
    after one that follows the copy: here the barrier is where the owner, on another
    core, reuses the region; the reader's check after it must see that."""
    from zps.core import rows

    arena = shm.Arena(MiB, "t")
    reader = shm.Mapper()
    calls: list[str] = []
    try:
        desc = arena.put(_data(1000))
        assert desc is not None

        def reuse_at_the_barrier() -> None:
            calls.append("barrier")
            if len(calls) == 1:  # the reader's: the owner frees the region meanwhile
                arena.free(desc[5])  # (its own barrier after the token's store)

        monkeypatch.setattr(shm.region, "fence", reuse_at_the_barrier)
        with pytest.raises(shm.ShmUnavailableError, match="reused while it was read") as e:
            reader.read(desc)
        assert e.value.token == desc[5] and not e.value.permanent  # told to the client
        assert calls == ["barrier", "barrier"]  # the reader's, then free's
        assert not rows.BARRIER or rows.memory_ordered("aarch64")  # compiled: any CPU
    finally:
        reader.close()
        arena.close()


_OWNER = """
import sys, numpy as np
from zps import shm
a = shm.Arena(1 << 20, "owner")
print(*a.put(np.arange(1000, dtype=np.uint8)), flush=True)
sys.stdin.readline()
"""


def test_a_dead_owners_memory_is_unmapped_and_refused() -> None:
    """The owner's memfd is in no directory; once it is SIGKILLed the reader drops its
    mapping (so the kernel frees the memory) and refuses its descriptors."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    mapper = shm.Mapper()
    try:
        assert owner.stdout is not None
        d = [int(x) for x in owner.stdout.readline().split()]
        assert mapper.read(d).tobytes() == np.arange(1000, dtype=np.uint8).tobytes()
        assert mapper.mapped == 1
        assert not [n for n in os.listdir("/dev/shm") if f"zps-{owner.pid}" in n]
        owner.kill()
        owner.wait(10)
        assert mapper.sweep() == 1 and mapper.mapped == 0
        with pytest.raises(shm.ShmUnavailableError) as err:
            mapper.read(d)
        assert not err.value.permanent
        maps = Path(f"/proc/{os.getpid()}/maps").read_text()
        assert f"zps-{owner.pid}-owner" not in maps
    finally:
        owner.kill()
        owner.wait(10)
        mapper.close()


def _reply(arr: np.ndarray) -> list[Any]:
    enc = Encoder()
    return list(enc.build(Route(MsgType.REPLY, 0, 1, 7), {"st": "OK", "a": [enc.array(arr)]}))


def test_a_lent_array_is_named_and_held_until_its_reader_is_done() -> None:
    """A shard's dense values live in its arena: a reply names them (no copy) and
    keeps them referred to, so a push meanwhile writes a new array, until the reader
    it went to says it is done."""
    owner = shm.SharedMemory(8 * MiB, "o", min_bytes=MiB, reclaim_after=0.5)
    reader = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        values = owner.reserve_array((1, MiB // 2), np.float32)  # 2 MiB
        assert values is not None and owner.array_bytes == 2 * MiB
        values[...] = np.arange(MiB // 2, dtype=np.float32)
        alone = sys.getrefcount(values)
        view = values.reshape(-1)
        out, descs = owner.outbound(_reply(view), lend_to=b"a", now=10.0)
        del view
        assert out[2] == b"" and len(descs) == 1 and owner.arena.puts == 1  # no copy
        assert sys.getrefcount(values) > alone  # lent: held by the loan
        token = descs[0][6]
        got = decode(reader.inbound(out, decode(out).header).frames)
        arr = array_from(got.header["a"][0], got.payloads, max_bytes=1 << 30)
        assert arr.tobytes() == values.tobytes()
        owner.free([token], reader=b"b")  # another reader's "done" ends nothing
        assert owner.stats()["loans"] == 1 and sys.getrefcount(values) > alone
        owner.free([token], reader=b"a")
        assert owner.stats()["loans"] == 0 and sys.getrefcount(values) == alone
        assert owner.arena.live == 1  # the array's region stays while the array does
        del values
        owner.housekeeping()
        assert owner.arena.live == 0 and owner.array_bytes == 0
    finally:
        owner.close()
        reader.close()


def test_a_loan_past_reclaim_after_ends_and_a_late_read_is_refused() -> None:
    """A reader that never says it is done (paused, gone, its reply dropped) pins a
    chunk for ``reclaim_after`` at most: then the loan ends, and a chunk still held
    gets a new token first, so a read of the old descriptor (which may now meet
    bytes changed in place) is refused, never torn."""
    owner = shm.SharedMemory(8 * MiB, "o", min_bytes=MiB, reclaim_after=0.5)
    reader = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        values = owner.reserve_array((1, MiB // 2), np.float32)
        assert values is not None
        values[...] = 1.0
        alone = sys.getrefcount(values)
        out, _ = owner.outbound(_reply(values.reshape(-1)), lend_to=b"slow", now=100.0)
        owner.housekeeping(now=100.4)  # not yet
        assert owner.stats()["loans"] == 1 and owner.expired == 0
        owner.housekeeping(now=100.6)
        assert owner.stats()["loans"] == 0 and owner.expired == 1 and owner.retokened == 1
        assert sys.getrefcount(values) == alone
        values[...] = 2.0  # the owner may now change it in place
        with pytest.raises(shm.ShmUnavailableError):
            reader.inbound(out, decode(out).header)
        # A new reply names the region by its new token, readable; the region goes
        # with the array (its token, the new one, cleared).
        again, descs = owner.outbound(_reply(values.reshape(-1)), lend_to=b"b", now=101.0)
        got = decode(reader.inbound(again, decode(again).header).frames)
        assert array_from(got.header["a"][0], got.payloads, max_bytes=1 << 30).min() == 2.0
        owner.free(shm.tokens(descs), reader=b"b")
        del values
        owner.housekeeping(now=101.1)
        assert owner.arena.live == 0 and owner.staged_regions == 0 and owner.tracked_tokens == 0
    finally:
        owner.close()
        reader.close()


def test_arrays_take_at_most_a_quarter_of_the_budget() -> None:
    sm = shm.SharedMemory(8 * MiB, "o", min_bytes=MiB)
    try:
        a = sm.reserve_array((MiB // 4,), np.float32)  # 1 MiB
        b = sm.reserve_array((MiB // 4,), np.float32)
        assert a is not None and b is not None and sm.array_bytes == 2 * MiB
        assert sm.reserve_array((1,), np.float32) is None  # past 8 MiB / 4
        assert sm.reserve(MiB) is not None  # frames still have their room
        del a
        assert sm.reserve_array((MiB // 8,), np.float64) is not None  # a's room, once gone
    finally:
        sm.close()


def test_inbound_checks_the_frames_asked_as_it_reads_them() -> None:
    """``check``: payload index -> float item size.  Those read and found finite are
    in ``Inbound.finite``; a NaN or one not asked for is not (the receiver checks it
    as usual); the bytes are those sent either way."""
    sender = shm.SharedMemory(16 * MiB, "s", min_bytes=MiB)
    receiver = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        rng = np.random.default_rng(8)
        good = rng.standard_normal(MiB // 2).astype(np.float32)
        bad = good.copy()
        bad[-1] = np.nan
        other = rng.standard_normal(MiB // 4)  # float64, not asked for
        frames, arrays = _request(good, bad, other)
        out, _ = sender.outbound(frames)
        got = receiver.inbound(out, decode(out).header, check={0: 4, 1: 4})
        assert got.finite == {0}
        msg = decode(got.frames)
        for i, a in enumerate(arrays):
            b = array_from(msg.header["ops"][i]["g"], msg.payloads, max_bytes=1 << 30)
            assert b.tobytes() == a.tobytes()
        assert receiver.inbound(out, decode(out).header).finite == frozenset()
    finally:
        sender.close()
        receiver.close()


def test_an_expired_loan_retokens_only_once_the_younger_loans_end() -> None:
    """A loan that expires while a younger one holds the region: the younger reader
    still reads it (the array cannot change while lent); the token changes when the
    last loan ends, before the owner may change it in place, so the expired reader's
    late read is refused then.  ``loan_after`` sets the loans' time."""
    owner = shm.SharedMemory(8 * MiB, "o", min_bytes=MiB, reclaim_after=0.5, loan_after=2.0)
    reader = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        values = owner.reserve_array((1, MiB // 2), np.float32)
        assert values is not None
        values[...] = 3.0
        slow, _ = owner.outbound(_reply(values.reshape(-1)), lend_to=b"slow", now=100.0)
        young, descs = owner.outbound(_reply(values.reshape(-1)), lend_to=b"b", now=101.9)
        owner.housekeeping(now=101.0)  # past reclaim_after, not loan_after: nothing ends
        assert owner.stats()["loans"] == 2
        owner.housekeeping(now=102.1)  # the slow loan expires; the young one holds on
        assert owner.expired == 1 and owner.retokened == 0
        got = decode(reader.inbound(young, decode(young).header).frames)
        assert array_from(got.header["a"][0], got.payloads, max_bytes=1 << 30).min() == 3.0
        owner.free(shm.tokens(descs), reader=b"b")  # the last loan ends: a new token
        assert owner.retokened == 1 and owner.stats()["loans"] == 0
        values[...] = 4.0  # the owner may now change it in place
        with pytest.raises(shm.ShmUnavailableError):
            reader.inbound(slow, decode(slow).header)
    finally:
        owner.close()
        reader.close()


def test_slices_of_a_buffer_are_named_where_they_are_and_never_copied() -> None:
    """A gradient written into a buffer is sent chunk by chunk as slices of it: each
    payload names its place in the buffer's region (``skip``), nothing is copied on
    the sending side, and the receiver reads the same bits."""
    sender = shm.SharedMemory(16 * MiB, "s", min_bytes=MiB)
    receiver = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        buf = sender.buffer((MiB,), np.float32)  # 4 MiB
        assert buf is not None and buf.shape == (MiB,) and not buf.any()
        buf[:] = np.random.default_rng(3).standard_normal(MiB).astype(np.float32)
        half = MiB // 2
        frames, arrays = _request(buf[:half], buf[half:])
        out, descs = sender.outbound(frames)
        assert sender.arena.puts == 1  # the buffer's own region only
        assert [d[0] for d in descs] == [0, 1] and [d[7] for d in descs] == [0, half * 4]
        assert [d[5] for d in descs] == [half * 4, half * 4] and out[2] == out[3] == b""
        msg = decode(receiver.inbound(out, decode(out).header).frames)
        for op, a in zip(msg.header["ops"], arrays, strict=True):
            assert array_from(op["g"], msg.payloads, max_bytes=1 << 30).tobytes() == a.tobytes()
        again, same = sender.outbound(frames, reuse=descs)
        assert same == descs and again[2] == again[3] == b"" and sender.arena.puts == 1
        assert sender.stats()["buffered"] == 2
        # A descriptor past the region's end is refused, never read.
        bad = [*descs[1][1:5], descs[1][5] + 4, *descs[1][6:]]
        with pytest.raises(shm.ShmUnavailableError):
            receiver.mapper.read(bad)
    finally:
        sender.close()
        receiver.close()


def test_a_buffer_gets_a_new_token_once_no_request_names_it() -> None:
    """A request's copy that reaches its reader after the request is over (a duplicate,
    a timed-out send) must not read what the caller wrote into the buffer since: once
    the last request naming it is freed, its region has a new token, and the old
    descriptor is refused.  While another request names it, it keeps its token."""
    sender = shm.SharedMemory(16 * MiB, "s", min_bytes=MiB)
    receiver = shm.SharedMemory(MiB, "r", min_bytes=MiB)
    try:
        buf = sender.buffer((MiB,), np.float32)
        assert buf is not None
        buf[:] = 1
        first, _ = sender.outbound(_request(buf[: MiB // 2])[0])
        second, _ = sender.outbound(_request(buf[MiB // 2 :])[0])
        d1 = shm.descriptors(decode(first).header[shm.KEY]["d"])
        d2 = shm.descriptors(decode(second).header[shm.KEY]["d"])
        sender.free(shm.tokens(d1))  # the first is over; the second is not
        assert sender.stats()["retokened"] == 0
        receiver.inbound(first, decode(first).header)  # a late copy: still the same bytes
        sender.free(shm.tokens(d2))
        assert sender.stats()["retokened"] == 1
        buf[:] = 2  # the caller's next gradient
        for late in (first, second):
            with pytest.raises(shm.ShmUnavailableError):
                receiver.inbound(late, decode(late).header)
        # The next request names it under its new token.
        third, d3 = sender.outbound(_request(buf[: MiB // 2])[0])
        assert d3[0][6] != d1[0][6]
        got = decode(receiver.inbound(third, decode(third).header).frames)
        assert (array_from(got.header["ops"][0]["g"], got.payloads, max_bytes=1 << 30) == 2).all()
        # Its region goes with the array.
        sender.free(shm.tokens(d3))
        del buf, first, second, third, got
        sender.outbound(_request(np.zeros(4, np.float32))[0])
        assert sender.arena.live == 0 and sender.buffer_regions == 0 and sender.tracked_tokens == 0
    finally:
        sender.close()
        receiver.close()


def test_a_full_budget_gives_no_buffer() -> None:
    sender = shm.SharedMemory(2 * MiB, "s", min_bytes=MiB)
    try:
        assert sender.buffer((MiB,), np.float32) is None  # 4 MiB
        assert sender.buffer((MiB // 4,), np.float32) is not None
    finally:
        sender.close()


def test_a_slice_not_8_byte_aligned_is_copied_not_named() -> None:
    sender = shm.SharedMemory(16 * MiB, "s", min_bytes=MiB)
    try:
        buf = sender.buffer((MiB + 1,), np.float32)
        assert buf is not None
        _, descs = sender.outbound(_request(buf[1:])[0])
        assert len(descs) == 1 and len(descs[0]) == 7 and sender.stats()["buffered"] == 0
    finally:
        sender.close()


def test_a_descriptor_naming_an_empty_file_is_refused(tmp_path: Path) -> None:
    """Not a zps arena (an empty regular file the sender has open): refused as
    unavailable shared memory, not an error escaping the reader."""
    with open(tmp_path / "empty", "wb") as f:
        ino = os.fstat(f.fileno()).st_ino
        for desc in (
            [os.getpid(), f.fileno(), ino, 0, 0, 1],
            [os.getpid(), f.fileno(), ino, 0, 0, 1, 0],
        ):
            with pytest.raises(shm.ShmUnavailableError):
                shm.Mapper().read(desc)


@pytest.mark.parametrize("entries", [0, 1, 14, 15, 16, 65534, 65535, 70000])
def test_an_entry_is_added_to_an_encoded_map_without_decoding_it(entries: int) -> None:
    """``with_entry`` raises a msgpack map's count in place, across the fixmap, map 16
    and map 32 forms, and refuses what is not a map."""
    header = {f"k{i}": i for i in range(entries)}
    packed = msgpack.packb(header, use_bin_type=True)
    info = {"h": "host", "d": [[0, 1, 2, 3, 4, 5, 6]], "r": True}
    got = msgpack.unpackb(shm.with_entry(packed, shm.KEY, info), raw=False)
    assert got == {**header, shm.KEY: info}
    assert list(got)[-1] == shm.KEY


@pytest.mark.parametrize("not_a_map", [b"", msgpack.packb([1, 2]), msgpack.packb(7)])
def test_adding_an_entry_to_what_is_not_a_map_is_a_protocol_error(not_a_map: bytes) -> None:
    with pytest.raises(ProtocolError, match="must be a map"):
        shm.with_entry(not_a_map, shm.KEY, {})
