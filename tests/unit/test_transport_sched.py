"""zmq's I/O threads under SCHED_BATCH (zps.transport.new_context): a server's by
default, a client's from the start only with ZPS_IO_SCHED=batch (by default it switches
as it works: zps.transport.IoThreads, here and in tests/integration/test_io_sched.py),
none with ZPS_IO_SCHED=normal, and none where the policy cannot be set (libzmq would
abort the process)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from zps import transport
from zps.transport import iothreads

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
    reason="Linux scheduling policies",
)


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _io_policy(client: bool) -> int:
    """The policy of the I/O thread of a new context's first socket."""
    ctx = transport.new_context(client=client)  # pyzmq's collector, once per process,
    ctx.term()  # has a context and an I/O thread of its own: started before counting
    before = _threads()
    ctx = transport.new_context(client=client)
    sock = ctx.socket(zmq.DEALER)
    try:
        # libzmq's thread names itself and sets its policy as it starts: wait for that.
        deadline = time.monotonic() + 5
        while True:
            io = [t for t in _threads() - before if _comm(t).startswith("ZMQbg/IO")]
            if io or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        assert len(io) == 1, [_comm(t) for t in _threads() - before]
        return os.sched_getscheduler(io[0])
    finally:
        sock.close(0)
        ctx.term()


@pytest.fixture(autouse=True)
def _allowed() -> None:
    if not iothreads.batch_allowed():
        pytest.skip("this process may not set SCHED_BATCH")


def test_servers_batch_clients_normal_at_first_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    assert _io_policy(client=False) == os.SCHED_BATCH
    assert _io_policy(client=True) == os.SCHED_OTHER


def test_batch_for_clients_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZPS_IO_SCHED", "batch")
    assert _io_policy(client=True) == os.SCHED_BATCH


def test_normal_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZPS_IO_SCHED", "normal")
    assert _io_policy(client=False) == os.SCHED_OTHER


def test_left_alone_where_the_policy_cannot_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox that forbids sched_setscheduler: the probe fails, nothing is asked of
    libzmq (which would abort the process)."""
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    monkeypatch.setattr(iothreads, "batch_allowed", lambda: False)
    assert _io_policy(client=False) == os.SCHED_OTHER


def test_the_probe_fails_when_the_call_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    assert transport.probe_batch()  # allowed here (see _allowed): refused below only
    monkeypatch.setattr(os, "sched_setscheduler", refused)
    assert not transport.probe_batch()


def test_an_unknown_mode_keeps_the_default_policy_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ZPS_IO_SCHED", "off")
    with caplog.at_level("WARNING", logger="zps.transport"):
        assert _io_policy(client=False) == os.SCHED_OTHER
    assert "ZPS_IO_SCHED='off' is none of auto, servers, batch, normal" in caplog.text


def _named(io: transport.IoThreads) -> list[int]:
    """The threads of ``io``'s context, once they have named themselves (as they start:
    no event says so)."""
    deadline = time.monotonic() + 5
    while True:
        tids = [t for t, name in transport.threads() if name.startswith(io.thread_name)]
        if tids or time.monotonic() > deadline:
            return tids
        time.sleep(0.005)


@contextlib.contextmanager
def _io_threads() -> Iterator[tuple[transport.IoThreads, list[int]]]:
    """A context's IoThreads, and its I/O threads once they have started."""
    ctx: zmq.Context[Any] = zmq.Context()
    io = transport.IoThreads(ctx)
    sock = ctx.socket(zmq.DEALER)
    try:
        yield io, _named(io)
    finally:
        sock.close(0)
        ctx.term()


def test_io_threads_switch_on_a_change_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    with _io_threads() as (io, tids):
        assert len(tids) == 1 and _comm(tids[0]).endswith("/ZMQbg/IO/0")
        calls: list[int] = []
        real = os.sched_setscheduler

        def counted(*a: Any) -> None:
            calls.append(a[1])
            real(*a)

        monkeypatch.setattr(os, "sched_setscheduler", counted)
        io.busy(False)  # already the default: nothing to do
        assert calls == [] and os.sched_getscheduler(tids[0]) == os.SCHED_OTHER
        io.busy(True)
        io.busy(True)
        assert calls == [os.SCHED_BATCH] and os.sched_getscheduler(tids[0]) == os.SCHED_BATCH
        io.busy(False)
        assert os.sched_getscheduler(tids[0]) == os.SCHED_OTHER and io.switches == 2


def test_io_threads_left_alone_once_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    with _io_threads() as (io, tids):

        def refused(*args: object) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "sched_setscheduler", refused)
        io.busy(True)  # no error: the policy stays, and is not asked for again
        assert not io.batch and io.switches == 0 and not io.looking
        assert os.sched_getscheduler(tids[0]) == os.SCHED_OTHER


@pytest.mark.parametrize("mode", ["servers", "batch", "normal"])
def test_io_threads_switch_only_in_auto_mode(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZPS_IO_SCHED", mode)

    def never(*args: object) -> None:
        raise AssertionError("sched_setscheduler called outside auto mode")

    monkeypatch.setattr(os, "sched_setscheduler", never)
    ctx: zmq.Context[Any] = zmq.Context()
    io = transport.IoThreads(ctx)
    sock = ctx.socket(zmq.DEALER)
    try:
        io.busy(True)
        assert io.thread_name == "" and io.switches == 0 and not io.batch  # not even named
    finally:
        sock.close(0)
        ctx.term()


def test_io_threads_keep_a_policy_they_started_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client made by a thread run under SCHED_BATCH (say, a process under ``chrt -b``):
    its I/O thread inherits that policy and keeps it, busy or not."""
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    made: list[Any] = []

    def make() -> None:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        ctx: zmq.Context[Any] = zmq.Context()
        made.extend([ctx, transport.IoThreads(ctx)])
        made.append(ctx.socket(zmq.DEALER))  # starts its threads, which inherit BATCH

    t = threading.Thread(target=make)
    t.start()
    t.join()
    ctx, io, sock = made
    try:
        tids = _named(io)
        io.busy(True)
        io.busy(False)
        assert io.switches == 0 and io.thread_ids == () and not io.looking
        assert tids and all(os.sched_getscheduler(x) == os.SCHED_BATCH for x in tids)
    finally:
        sock.close(0)
        ctx.term()


def test_io_threads_left_alone_in_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child's IoThreads holds its parent's thread ids: it sets nothing."""
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    with _io_threads() as (io, tids):
        io.busy(True)  # found and switched in the parent
        assert io.thread_ids and os.sched_getscheduler(tids[0]) == os.SCHED_BATCH
        pid = os.fork()
        if pid == 0:  # the child: the same object, the parent's threads
            try:
                io.busy(False)
                ok = io.switches == 1 and io.thread_ids == () and not io.looking
                os._exit(0 if ok else 1)
            finally:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.sched_getscheduler(tids[0]) == os.SCHED_BATCH  # the parent's, untouched
        io.busy(False)
        assert os.sched_getscheduler(tids[0]) == os.SCHED_OTHER


def test_io_threads_prefixes_are_not_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted modulo 1000: a prefix a live thread of the process carries is skipped."""
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    with _io_threads() as (first, tids):
        assert tids
        taken = (int(first.thread_name.split("/", 1)[0]) + 1) % 1000  # the next one counted
        named = threading.Event()
        release = threading.Event()

        def carry(prefix: int) -> None:  # a thread named as a live context's I/O thread
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write(f"{prefix}/ZMQbg/IO/0")
            named.set()
            release.wait(10)

        t = threading.Thread(target=carry, args=(taken,))
        t.start()
        try:
            assert named.wait(10)
            ctx: zmq.Context[Any] = zmq.Context()
            try:
                assert transport.IoThreads(ctx).thread_name == f"{(taken + 1) % 1000}/ZMQbg/IO/"
            finally:
                ctx.term()
        finally:
            release.set()
            t.join()
