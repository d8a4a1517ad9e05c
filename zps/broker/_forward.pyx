# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The broker's data path as one compiled step (zps.broker.forward).

pump() takes the messages queued on the broker's ROUTER socket and forwards the two kinds
that make up nearly all of its traffic, exactly as the broker's Python fast path does
(zps.broker.datapath, by the rules of zps.broker.acceptance and zps.broker.routes):

  a client's REQUEST  [client, route, ...] -> [primary of route's partition, client, route, ...]
  a shard's reply     [shard, client, ...] -> [client, ...]

The frames are moved, not copied (zmq_msg_send takes each received zmq_msg_t).  Any other
message, and any of these two that needs a decision the Python code makes (no primary, the
broker holding, a peer with messages held for it, a full or gone peer queue, a reply from a
shard not in the membership, a malformed or other-version route frame), is received but not
forwarded: pump() returns it, as a list of bytes, and the caller hands it to the Python
path, which decides.  Nothing is sent for a returned message, so that decision is the only
one.  Where a request goes is the route table's word (zps.broker.routes): routes[p] is the
identity its rule gives partition p outside the hold, or None when the rule refuses (the
Python path says why); this step only reads it.

libzmq is declared by pyzmq's own ``libzmq.pxd`` and linked by the soname of the libzmq
pyzmq ships (setup.py): ``import zmq`` has loaded that library, so the dynamic linker
resolves these calls to the same instance pyzmq's sockets run on; the socket is pyzmq's own
(Socket.underlying).  Everything runs on the broker's thread, with the GIL held,
non-blocking.  Optional: without a compiler, or without a libzmq shipped by pyzmq, the
broker forwards in Python.
"""

from cpython.bytes cimport (
    PyBytes_AS_STRING,
    PyBytes_Check,
    PyBytes_FromStringAndSize,
    PyBytes_GET_SIZE,
)
from cpython.dict cimport PyDict_Check, PyDict_Contains, PyDict_SetItem, PyDict_Size
from cpython.list cimport PyList_Check, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.errno cimport EAGAIN
from libc.stdint cimport int32_t, uint32_t
from libc.string cimport memcmp, memcpy

from zmq.backend.cython.libzmq cimport (
    ZMQ_DONTWAIT,
    ZMQ_EVENTS,
    ZMQ_POLLIN,
    ZMQ_SNDMORE,
    zmq_errno,
    zmq_getsockopt,
    zmq_msg_close,
    zmq_msg_data,
    zmq_msg_init,
    zmq_msg_init_size,
    zmq_msg_more,
    zmq_msg_move,
    zmq_msg_recv,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
)

# What this step shares with the Python code, each checked against it by
# tests/unit/test_forward_wire.py (a change on one side alone fails there).
cdef extern from *:
    r"""
/* The route frame (zps.protocol.codec.ROUTE, "<2sBBiIQ"): magic, version, type,
 * partition (little-endian int32), epoch, request id. */
#define ROUTE_SIZE 20             /* codec.ROUTE.size */
#define ROUTE_MAGIC "ZP"          /* codec.MAGIC */
#define ROUTE_MAGIC_LEN 2
#define ROUTE_VERSION_AT 2        /* offset of the version byte */
#define PROTOCOL_VERSION 1        /* codec.PROTOCOL_VERSION */
#define ROUTE_TYPE_AT 3           /* offset of the message type byte */
#define MSG_REQUEST 1             /* codec.MsgType.REQUEST */
#define ROUTE_PARTITION_AT 4      /* offset of the partition */
/* Identities (zps.core.membership): a shard's, and a shard's liveness link's. */
#define SHARD_PREFIX "s-"         /* membership.SHARD_PREFIX */
#define SHARD_PREFIX_LEN 2
#define LIVENESS_PREFIX "h-s-"    /* membership.LIVENESS_PREFIX + SHARD_PREFIX */
#define LIVENESS_PREFIX_LEN 4
/* A shard's target frame starting with this byte names a pseudo client of the broker
 * (acceptance.COMMIT_TARGET, MOVE_TARGET): never forwarded here. */
#define PSEUDO_TARGET '\0'
    """
    enum:
        ROUTE_SIZE
        ROUTE_MAGIC_LEN
        ROUTE_VERSION_AT
        PROTOCOL_VERSION
        ROUTE_TYPE_AT
        MSG_REQUEST
        ROUTE_PARTITION_AT
        SHARD_PREFIX_LEN
        LIVENESS_PREFIX_LEN
    const char *ROUTE_MAGIC
    const char *SHARD_PREFIX
    const char *LIVENESS_PREFIX
    const char PSEUDO_TARGET

cdef extern from "<dlfcn.h>":
    ctypedef struct Dl_info:
        const char *dli_fname
    int dladdr(const void *addr, Dl_info *info)

cdef extern from "Python.h":
    object PyUnicode_DecodeFSDefault(const char *s)

cdef enum:
    FRAMES = 16  # frames of a message held on the stack; more are moved to the heap

cdef enum Verdict:
    DECLINE = 0  # left to Python, nothing sent
    ROUTED = 1   # a client's request, sent to its partition's primary
    REPLIED = 2  # a shard's reply, sent to its client


cdef int _events_of(void *sock) noexcept:
    """ZMQ_EVENTS, or -1 when the socket failed."""
    cdef int events = 0
    cdef size_t size = sizeof(events)
    if zmq_getsockopt(sock, ZMQ_EVENTS, &events, &size) != 0:
        return -1
    return events


cdef void _close_all(zmq_msg_t *m, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        zmq_msg_close(&m[i])


cdef list _as_list(zmq_msg_t *m, Py_ssize_t n):
    """The frames as bytes (copies); the messages are closed either way."""
    cdef Py_ssize_t i
    try:
        return [
            PyBytes_FromStringAndSize(<char *>zmq_msg_data(&m[i]), zmq_msg_size(&m[i]))
            for i in range(n)
        ]
    finally:
        _close_all(m, n)


cdef bint _starts(zmq_msg_t *m, const char *prefix, size_t length) noexcept:
    return zmq_msg_size(m) >= length and memcmp(zmq_msg_data(m), prefix, length) == 0


cdef bint _held(object queues, zmq_msg_t *m) except -1:
    """Whether the peer named by m's bytes has messages held for it (queues: the broker's
    Outbound's held queues, keyed by identity)."""
    if PyDict_Size(queues) == 0:
        return False
    key = PyBytes_FromStringAndSize(<char *>zmq_msg_data(m), zmq_msg_size(m))
    return PyDict_Contains(queues, key) == 1


cdef void _send_rest(void *sock, zmq_msg_t *m, Py_ssize_t start, Py_ssize_t n) noexcept:
    """Send m[start..n) after whatever was sent with SNDMORE, then close all n: the
    message's first frame went out, so zmq takes the rest (a ROUTER decides at the
    first)."""
    cdef Py_ssize_t i
    for i in range(start, n):
        zmq_msg_send(&m[i], sock, ZMQ_DONTWAIT | (ZMQ_SNDMORE if i + 1 < n else 0))
    _close_all(m, n)


cdef object _forward(void *sock, zmq_msg_t *m, Py_ssize_t n, object routes, object shards,
                     object queues, bint holding, Verdict *verdict):
    """One message m[0..n): forwarded (``verdict`` ROUTED or REPLIED; m closed) or left to
    Python (DECLINE: nothing sent, m open).  Returns the sender's identity as text where
    it was forwarded.  A Python error is raised with nothing sent, m open."""
    verdict[0] = DECLINE
    if n < 3:
        return None
    cdef const char *ident = <const char *>zmq_msg_data(&m[0])
    cdef size_t ident_len = zmq_msg_size(&m[0])
    cdef const char *t
    cdef const unsigned char *r
    cdef const unsigned char *pr
    cdef int32_t p
    cdef zmq_msg_t first
    cdef Py_ssize_t first_len
    if _starts(&m[0], SHARD_PREFIX, SHARD_PREFIX_LEN):
        # A shard's reply: [shard, client, ...] -> [client, ...].
        t = <const char *>zmq_msg_data(&m[1])
        if (zmq_msg_size(&m[1]) == 0 or t[0] == PSEUDO_TARGET
                or _starts(&m[1], SHARD_PREFIX, SHARD_PREFIX_LEN)):
            return None  # control, commit or move answers, replies to shards
        node = PyUnicode_DecodeUTF8(<char *>ident, <Py_ssize_t>ident_len, "replace")
        if PyDict_Contains(shards, node) != 1 or _held(queues, &m[1]):
            return None
        if zmq_msg_send(&m[1], sock, ZMQ_DONTWAIT | ZMQ_SNDMORE) < 0:
            return None  # full or gone: the Python path holds, drops or counts it
        _send_rest(sock, m, 2, n)
        verdict[0] = REPLIED
        return node
    if _starts(&m[0], LIVENESS_PREFIX, LIVENESS_PREFIX_LEN):
        return None  # a shard's liveness link
    # A client's message: a REQUEST of this protocol version goes to its primary.
    r = <const unsigned char *>zmq_msg_data(&m[1])
    if (zmq_msg_size(&m[1]) != ROUTE_SIZE or memcmp(r, ROUTE_MAGIC, ROUTE_MAGIC_LEN) != 0
            or r[ROUTE_VERSION_AT] != PROTOCOL_VERSION or r[ROUTE_TYPE_AT] != MSG_REQUEST
            or holding):
        return None
    pr = r + ROUTE_PARTITION_AT
    p = <int32_t>(<uint32_t>pr[0] | <uint32_t>pr[1] << 8 | <uint32_t>pr[2] << 16
                  | <uint32_t>pr[3] << 24)
    if p < 0 or p >= PyList_GET_SIZE(routes):
        return None
    target = <object>PyList_GET_ITEM(routes, p)
    if not PyBytes_Check(target):
        return None  # no primary: the route table says why (zps.broker.routes)
    if PyDict_Size(queues) != 0 and PyDict_Contains(queues, target) == 1:
        return None
    node = PyUnicode_DecodeUTF8(<char *>ident, <Py_ssize_t>ident_len, "replace")
    first_len = PyBytes_GET_SIZE(target)
    if zmq_msg_init_size(&first, <size_t>first_len) != 0:
        raise MemoryError()
    memcpy(zmq_msg_data(&first), PyBytes_AS_STRING(target), <size_t>first_len)
    if zmq_msg_send(&first, sock, ZMQ_DONTWAIT | ZMQ_SNDMORE) < 0:
        zmq_msg_close(&first)
        return None  # full or gone: the Python path decides
    _send_rest(sock, m, 0, n)
    verdict[0] = ROUTED
    return node


def pump(Py_ssize_t sock, Py_ssize_t limit, routes, shards, last, queues, bint holding, now):
    """pump(sock, limit, routes, shards, last, queues, holding, now) -> (events, routed,
    replies, declined): forward queued requests and replies.

    Forwards queued messages until none is left (events: the last ZMQ_EVENTS reading),
    ``limit`` were forwarded (events: 0; more may be queued), or one is declined
    (declined: its frames as bytes; events: 0).  events is -1 when the socket failed (the
    caller's own receive reports it).  routes: the route table's targets
    (zps.broker.routes.RouteTable.targets: the primary's identity, bytes, or None);
    shards: the membership (names); last: the failure detector's last-heard times, set
    to ``now`` for each sender forwarded; queues: the identities with messages held for
    them; holding: the broker is collecting claims."""
    if not (PyList_Check(routes) and PyDict_Check(shards) and PyDict_Check(last)
            and PyDict_Check(queues)):
        raise TypeError("pump needs a list and three dicts")
    cdef void *s = <void *>sock
    cdef zmq_msg_t stack[FRAMES]
    cdef zmq_msg_t *m = stack
    cdef zmq_msg_t *bigger
    cdef Py_ssize_t cap = FRAMES, n = 0, i, k
    cdef long routed = 0, replies = 0
    cdef int events = 0, err, more
    cdef Verdict verdict
    declined = None
    try:
        while routed + replies < limit:
            while True:  # one whole message into m[0..n)
                if n == cap:
                    bigger = <zmq_msg_t *>PyMem_Malloc(2 * cap * sizeof(zmq_msg_t))
                    if bigger == NULL:
                        raise MemoryError()
                    for i in range(n):
                        zmq_msg_init(&bigger[i])
                        zmq_msg_move(&bigger[i], &m[i])
                    if m != stack:
                        PyMem_Free(m)
                    m = bigger
                    cap *= 2
                zmq_msg_init(&m[n])
                if zmq_msg_recv(&m[n], s, ZMQ_DONTWAIT) < 0:
                    err = zmq_errno()
                    zmq_msg_close(&m[n])
                    if n == 0 and err == EAGAIN:
                        return (_events_of(s), routed, replies, declined)
                    return (-1, routed, replies, declined)  # the caller's receive raises it
                more = zmq_msg_more(&m[n])
                n += 1
                if not more:
                    break
            node = _forward(s, m, n, routes, shards, queues, holding, &verdict)
            if verdict == DECLINE:
                k, n = n, 0
                declined = _as_list(m, k)  # closes them
                return (0, routed, replies, declined)
            n = 0  # sent and closed
            PyDict_SetItem(last, node, now)
            if verdict == ROUTED:
                routed += 1
            else:
                replies += 1
            events = _events_of(s)
            if events < 0 or not (events & ZMQ_POLLIN):
                return (events, routed, replies, declined)
        return (0, routed, replies, declined)  # the limit: more may be queued
    finally:
        _close_all(m, n)  # a message left open by an error (or a socket that failed)
        if m != stack:
            PyMem_Free(m)


def bound():
    """bound() -> the file of the libzmq this step runs on (the dynamic linker's choice,
    read back with dladdr), or None where it cannot be told."""
    cdef Dl_info info
    if dladdr(<const void *>zmq_msg_send, &info) == 0 or info.dli_fname == NULL:
        return None
    return PyUnicode_DecodeFSDefault(info.dli_fname)
