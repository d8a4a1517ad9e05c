"""zmq contexts and the scheduling of their I/O threads.

Rules: zps never uses a process-global context: each owner makes its own
(:func:`new_context`) and ends it (:func:`term`).  A server's I/O threads run under
Linux's ``SCHED_BATCH`` where that can be set; a client's switch between it and the
default policy as the client works (:class:`IoThreads`); ``ZPS_IO_SCHED`` chooses
otherwise (:func:`io_sched_batch`).  A policy is set only after a probe thread showed
it can be (libzmq aborts the process if setting it fails), and a thread started under
a policy of the process's own keeps it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Any

import zmq
import zmq.asyncio

_log = logging.getLogger("zps.transport")


def new_context(client: bool = False) -> zmq.asyncio.Context:
    """A context per owner: zps never uses a process-global context.  A server's I/O
    threads (and a client's, with ``ZPS_IO_SCHED=batch``) are scheduled
    ``SCHED_BATCH`` where Linux allows it (see :func:`io_sched_batch`); a client's
    switch between the two policies as it works, by default (:class:`IoThreads`)."""
    ctx = zmq.asyncio.Context()
    batch = io_sched_batch(client)
    if batch:
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    _zero_copy_ready(batch)
    return ctx


class IoThreads:
    """The zmq I/O threads of one client's context, switched between ``SCHED_BATCH``
    while the client has several requests in flight and the default policy while it
    waits for one (``ZPS_IO_SCHED=auto``, the default; see :func:`io_sched_batch`).

    Under the default policy the I/O thread, woken by each send and each reply,
    preempts the client's own thread at once: what a lone request's caller wants (it
    waits for that one reply), and two context switches per message for a client with
    more to send and more replies to read (a training step's requests to every
    partition, a pipelined step, a tensor's chunks): such a client makes more sparse
    steps under ``SCHED_BATCH``, and a lone request is answered later under it
    (figures: docs/performance.md, the levers table).

    The context's threads are named with a prefix no live thread of the process uses
    (``ZMQ_THREAD_NAME_PREFIX``) and found by that name once they have started (they
    name themselves as they start).  ``busy(flag)`` sets the policy, one system call
    on a change and none otherwise.  Left alone: a thread that started under another
    policy than the default (a process run under ``chrt``: its policy is kept), a
    policy that cannot be set, threads that cannot be found, a libzmq without thread
    names, and a forked child (the thread ids are its parent's)."""

    _prefixes = iter(range(1 << 62))
    #: How many calls to :meth:`busy` look for the threads before giving up.
    FIND_TRIES = 64

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self._tids: list[int] = []
        self._tries = 0
        self._pid = os.getpid()
        self._name = ""
        self.batch = False
        self.switches = 0
        if not _adaptive_client():
            return
        prefix = self._free_prefix()
        try:
            ctx.set(zmq.THREAD_NAME_PREFIX, prefix)
        except zmq.ZMQError:  # a libzmq without thread names: nothing to find them by
            return
        self._name = f"{prefix}/ZMQbg/IO/"
        self._tries = self.FIND_TRIES

    @property
    def thread_name(self) -> str:
        """The name each of the context's I/O threads starts with (empty: the threads are
        left alone, never named nor looked for)."""
        return self._name

    @property
    def thread_ids(self) -> tuple[int, ...]:
        """The ids of the I/O threads found, whose policy :meth:`busy` sets (empty: not
        found yet, or left alone)."""
        return tuple(self._tids)

    @property
    def looking(self) -> bool:
        """Whether :meth:`busy` still looks for the threads (not found yet, tries left)."""
        return not self._tids and self._tries > 0

    @classmethod
    def _free_prefix(cls) -> int:
        """A prefix no thread of this process carries (a thread's name is at most 15
        bytes: "999/ZMQbg/IO/0" fits, so they are counted modulo 1000)."""
        used = {name.split("/", 1)[0] for _, name in threads() if "/ZMQbg/" in name}
        prefix = 0
        for _ in range(1000):
            prefix = next(cls._prefixes) % 1000
            if str(prefix) not in used:
                break
        return prefix

    def _find(self) -> bool:
        self._tries -= 1
        tids = [tid for tid, name in threads() if name.startswith(self._name)]
        try:
            if any(os.sched_getscheduler(t) != os.SCHED_OTHER for t in tids):
                self._tries = 0  # started under a policy of the process's own: kept
                return False
        except OSError:  # one ended meanwhile: looked for again next time
            return False
        self._tids = tids
        return bool(tids)

    def busy(self, flag: bool) -> None:
        """Whether the client has more than one request in flight."""
        if flag == self.batch or (not self._tids and (self._tries <= 0 or not self._find())):
            return
        if os.getpid() != self._pid:  # a forked child: those threads are its parent's
            self._tids, self._tries = [], 0
            return
        policy = os.SCHED_BATCH if flag else os.SCHED_OTHER
        try:
            for tid in self._tids:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:  # refused (or the thread ended): left as it is from now on
            self._tids, self._tries = [], 0
            return
        self.batch = flag
        self.switches += 1


def threads() -> list[tuple[int, str]]:
    """(id, name) of each thread of this process, read from /proc at each call (none
    where /proc cannot tell): how :class:`IoThreads` finds a context's I/O threads."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.append((int(tid), f.read().strip()))
        except OSError:
            continue  # the thread ended
    return out


_zero_copy_pid = 0


def _zero_copy_ready(batch: bool) -> None:
    """Start pyzmq's collector of zero-copy frames now, once per process.

    pyzmq starts it at the first frame sent without a copy: it imports a module and
    opens a thread, a context and two sockets.  A server that first sends a large frame
    when its descriptors are spent (EMFILE) would fail there, inside a reader callback,
    and stop serving; started with the process, a spent limit only refuses what needs a
    new descriptor (a client's shared memory: ``noshm: busy``).  Its context's I/O
    thread gets the process's policy (``batch``: see :func:`io_sched_batch`)."""
    global _zero_copy_pid
    if _zero_copy_pid == os.getpid():
        return
    from zmq.utils.garbage import gc

    if batch and not gc.is_alive():
        gc.context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)  # before its first socket
    zmq.Frame(b"\0", copy=False)  # dropped at once: its release goes through the collector
    _zero_copy_pid = os.getpid()


def io_sched_batch(client: bool) -> bool:
    """Whether zmq's I/O threads of a server (``client`` False: the broker, a shard, a
    routing broker) or of a client run under Linux's ``SCHED_BATCH`` policy from the
    start.  ``ZPS_IO_SCHED`` in the environment: ``auto`` (the default: servers'; a
    client's switch as it works, see :class:`IoThreads`), ``servers`` (servers' only),
    ``batch`` (clients' too, always) or ``normal`` (none).

    A thread woken under ``SCHED_BATCH`` never preempts the running one.  zmq wakes
    its I/O thread for each message sent, and under the default policy that thread
    preempted the sender at once, mid-handler: two context switches per message.  A
    server's handler then runs to its end (its wait for the next message) first, and
    the I/O thread after it, or at once on an idle core.  Servers then take less time
    and CPU per one-row pull and make more pipelined sparse steps; clients make more
    sparse steps too, but answer one-row pulls later (a lone request's caller waits for
    its reply, so its send should leave at once): hence ``auto`` (figures:
    docs/performance.md, the levers table).  The cost: while every core is busy, such a
    thread waits for the running one to block or use up its time slice (a few
    milliseconds at most) instead of preempting it."""
    mode = _io_sched_mode()
    if mode == "normal" or (client and mode != "batch"):
        return False
    return batch_allowed()


def _io_sched_mode() -> str:
    mode = os.environ.get("ZPS_IO_SCHED", "auto")
    if mode not in IO_SCHED_MODES:
        _warn_io_sched(mode)
        return "normal"
    return mode


def _adaptive_client() -> bool:
    """Whether a client switches its I/O threads' policy as it works (``auto``)."""
    return _io_sched_mode() == "auto" and batch_allowed()


#: The values of ``ZPS_IO_SCHED``.
IO_SCHED_MODES = ("auto", "servers", "batch", "normal")


@functools.cache
def _warn_io_sched(mode: str) -> None:
    _log.warning(
        "ZPS_IO_SCHED=%r is none of %s: zmq's I/O threads keep the default policy",
        mode,
        ", ".join(IO_SCHED_MODES),
    )


def batch_allowed() -> bool:
    """Whether this process may run threads under ``SCHED_BATCH``: the first answer of
    :func:`probe_batch`, kept for the life of the process (every policy decision reads
    it here)."""
    return _batch_allowed()


@functools.cache
def _batch_allowed() -> bool:
    return probe_batch()


def probe_batch() -> bool:
    """Whether a new thread of this process may set ``SCHED_BATCH``, asked again at each
    call.  libzmq sets the policy in each of its threads and aborts the process if that
    fails, so a probe thread tries ``SCHED_BATCH`` first (it may be refused where the
    call is filtered for it, or for a process under ``SCHED_IDLE`` without
    ``RLIMIT_NICE`` room), and the policy is left alone if it is."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            allowed.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="zps-sched-probe", daemon=True)
    t.start()
    t.join()
    return bool(allowed)


def term(ctx: zmq.asyncio.Context) -> None:
    with contextlib.suppress(zmq.ZMQError):
        ctx.destroy(0)
